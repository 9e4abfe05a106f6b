from ..core import EngineType as EngineType
