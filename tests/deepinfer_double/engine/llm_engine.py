from ..core import LLMEngine as LLMEngine
