"""A prompt's token ids held as packed little-endian uint32 words (`hashing.pack_tokens`).

The gateway's prompt encoder produces the packed words (block hashing reads them as they
are); a list of int objects costs ~20 ns per token to make and orjson ~20 more to write,
where orjson writes the words themselves at ~8 ns per token. So a prompt travels as
`PackedIds`: a read-only sequence of ints whose list is made only when something indexes
or iterates it, and which JSON writes from the words (`ids_json`, which every writer of a
worker request uses: orjson's numpy support, handed a view of the words).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, overload

import numpy as np
import orjson

# One `tolist` over a 1M-token prompt holds the GIL for ~20 ms, stalling the gateway's event
# loop while a large prompt is prepared in a thread; between chunks the GIL can be handed over.
_UNPACK_CHUNK = 32768


def unpacked(packed: bytes) -> list[int]:
    """The ids of little-endian uint32 words (`pack_tokens` reversed)."""
    words = np.frombuffer(packed, dtype="<u4")
    ids: list[int] = []
    for start in range(0, len(words), _UNPACK_CHUNK):
        ids += words[start:start + _UNPACK_CHUNK].tolist()
    return ids


class PackedIds(Sequence[int]):
    """Token ids over their packed words; equal to a list or tuple of the same ids."""

    __slots__ = ("packed", "_ids")

    def __init__(self, packed: bytes):
        if len(packed) % 4:
            raise ValueError(f"{len(packed)} bytes are not whole uint32 words")
        self.packed = packed
        self._ids: list[int] | None = None

    @property
    def ids(self) -> list[int]:
        """The ids as a list (made once)."""
        if self._ids is None:
            self._ids = unpacked(self.packed)
        return self._ids

    def array(self) -> np.ndarray[Any, np.dtype[np.uint32]]:
        """The words as a read-only numpy array (no copy)."""
        return np.frombuffer(self.packed, dtype="<u4")

    def __len__(self) -> int:
        return len(self.packed) >> 2

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> list[int]: ...
    def __getitem__(self, index: int | slice) -> int | list[int]:
        return self.ids[index]

    def __iter__(self) -> Iterator[int]:
        return iter(self.ids)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PackedIds):
            return self.packed == other.packed
        if isinstance(other, list | tuple):
            return len(other) == len(self) and self.ids == list(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.packed)

    def __repr__(self) -> str:
        return f"PackedIds({len(self)} ids)"


def _json_default(value: object) -> Any:
    """orjson's `default`: a `PackedIds` as its words."""
    if isinstance(value, PackedIds):
        return value.array()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def ids_json(value: Any) -> bytes:
    """orjson.dumps for a value that may hold `PackedIds`."""
    return orjson.dumps(value, default=_json_default, option=orjson.OPT_SERIALIZE_NUMPY)
