from ..core import EngineArgs as EngineArgs
