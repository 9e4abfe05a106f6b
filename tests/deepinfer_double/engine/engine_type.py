from ..core import EngineType

__all__ = ["EngineType"]
