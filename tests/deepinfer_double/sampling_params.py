from .core import SamplingParams

__all__ = ["SamplingParams"]
