from ..core import LLMEngine

__all__ = ["LLMEngine"]
