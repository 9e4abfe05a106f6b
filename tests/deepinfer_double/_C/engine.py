from ..core import RequestOutput, Sequence

__all__ = ["RequestOutput", "Sequence"]
