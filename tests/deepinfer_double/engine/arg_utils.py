from ..core import EngineArgs

__all__ = ["EngineArgs"]
