from .core import SamplingParams as SamplingParams
