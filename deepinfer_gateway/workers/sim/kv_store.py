"""The shared KV store tier (3FS-like), as a seam with an in-process implementation.

DeepSeek's production store keeps KV blocks on SSD for days (TTL by workload class:
3 days agent, 7 days chat) and serves them at ~400 Gbps per 8 GPUs, so loading a
cached prefix is far cheaper than recomputing it. Read bandwidth belongs to the
reading instance (its profile), not to the store, so the store only answers "which
leading blocks do you hold" and "keep these".

`InMemoryKvStore` is shared by all sim workers of one process (the demo runs them all
in one process). Its LRU capacity and lazy TTL expiry are exact; contention for read
bandwidth between workers is not modelled. Blocks are keyed by chained, format-salted
hashes, so SM100 and Ascend blocks never match each other.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from deepinfer_gateway.core.protocol import STORE_TTL_S, WorkloadClass


@dataclass(frozen=True)
class StorePut:
    stored: list[int]  # newly written blocks
    evicted: list[int]  # blocks dropped to make room (capacity, not TTL)
    expires_at: float


class SimKvStore(Protocol):
    def match(self, hashes: Sequence[int], now: float) -> int:
        """Number of leading blocks of `hashes` held and unexpired at `now` (unix time)."""

    def put(self, hashes: Sequence[int], workload_class: WorkloadClass, now: float) -> StorePut:
        """Write (or refresh the TTL of) a chain of blocks."""


@dataclass
class InMemoryKvStore:
    capacity_blocks: int = 10_000_000
    ttl_s: dict[str, float] = field(default_factory=lambda: dict(STORE_TTL_S))
    _blocks: OrderedDict[int, float] = field(default_factory=OrderedDict, repr=False)  # hash -> expires_at

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, hashes: Sequence[int], now: float) -> int:
        n = 0
        for h in hashes:
            expires = self._blocks.get(h)
            if expires is None:
                break
            if expires <= now:
                del self._blocks[h]
                break
            n += 1
        return n

    def put(self, hashes: Sequence[int], workload_class: WorkloadClass, now: float) -> StorePut:
        expires_at = now + self.ttl_s[workload_class]
        chain = hashes[: self.capacity_blocks]
        stored: list[int] = []
        blocks, add = self._blocks, stored.append
        get, move_to_end = blocks.get, blocks.move_to_end
        fresh = max(expires_at, 0.0)
        # Back to front, each block to the LRU end: prefixes outlive their extensions. A
        # held block keeps the later of its two expiries. get + move_to_end (+ a set only
        # when the expiry grows) is ~3x cheaper than pop + set on an OrderedDict.
        for h in reversed(chain):
            old = get(h)
            if old is None:
                blocks[h] = fresh
                add(h)
            else:
                move_to_end(h)
                if old <= now:  # expired: written anew
                    add(h)
                if expires_at > old:
                    blocks[h] = expires_at
        stored.reverse()
        evicted = [self._blocks.popitem(last=False)[0] for _ in range(len(self._blocks) - self.capacity_blocks)]
        return StorePut(stored, evicted, expires_at)
