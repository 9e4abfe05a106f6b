"""A worker's memory-tier prefix cache: LRU over chained block hashes.

Because hashes are chained, a block is only useful when every block before it is also
cached, so `match` counts leading hits. To keep that property under eviction, a chain
is inserted and touched back to front: its first block becomes the most recent, and
LRU eviction then takes a prefix's extensions before the prefix itself.

Every insertion and eviction is appended to the worker's SimKvEventLog (tier `memory`).
Cost: O(blocks) per call, dict operations only.

It also remembers the hashes it evicted (the latest `EVICTED_MEMORY` x its capacity, at most
`EVICTED_MAX`: a real profile's cache holds over a million blocks), so that
`evicted_among` can say how much of a prompt it prefills again because it let it go: an
eviction that costs something, since only a live session's (or a shared prefix's) blocks are
asked for again. Cache pressure's cost in one figure (the load report's
`evicted_recomputed_tokens_total`; bench/peers.py reports it per run).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from deepinfer_gateway.core.protocol import KvEventKind, KvTier
from deepinfer_gateway.workers.sim.kv_events import SimKvEventLog

EVICTED_MEMORY = 8  # evicted hashes remembered, in multiples of the capacity...
EVICTED_MAX = 1 << 18  # ...and at most this many (~30 MB)


class PrefixCache:
    def __init__(self, capacity_blocks: int, events: SimKvEventLog) -> None:
        if capacity_blocks < 1:
            raise ValueError("capacity_blocks must be >= 1")
        self.capacity = capacity_blocks
        self._events = events
        self._lru: OrderedDict[int, None] = OrderedDict()  # oldest first
        self._evicted: OrderedDict[int, None] = OrderedDict()  # oldest first
        self._evicted_limit = min(EVICTED_MEMORY * capacity_blocks, EVICTED_MAX)

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._lru

    def match(self, hashes: Sequence[int], touch: bool = True) -> int:
        """Number of leading blocks of `hashes` cached; touching them keeps them longer."""
        n = 0
        for h in hashes:
            if h not in self._lru:
                break
            n += 1
        if touch:
            for h in reversed(hashes[:n]):
                self._lru.move_to_end(h)
        return n

    def insert(self, hashes: Sequence[int]) -> None:
        """Cache a chain (or refresh it). Emits `stored` for new blocks, `evicted` for victims."""
        # Blocks past the capacity could not survive their own insertion: skip them, so
        # the victims below always belong to other, older chains.
        chain = hashes[: self.capacity]
        stored: list[int] = []
        lru, move_to_end, add = self._lru, self._lru.move_to_end, stored.append
        for h in reversed(chain):
            if h in lru:
                move_to_end(h)
            else:
                lru[h] = None
                add(h)
        stored.reverse()
        evicted = [self._lru.popitem(last=False)[0] for _ in range(len(self._lru) - self.capacity)]
        self._remember(stored, evicted)
        self._events.append(KvEventKind.STORED, KvTier.MEMORY, stored)
        self._events.append(KvEventKind.EVICTED, KvTier.MEMORY, evicted)

    def evicted_among(self, hashes: Sequence[int]) -> int:
        """How many of `hashes` (blocks a prompt prefills) this cache held and evicted."""
        was = self._evicted
        return sum(1 for h in hashes if h in was) if was else 0

    def _remember(self, stored: list[int], evicted: list[int]) -> None:
        was = self._evicted
        if was:
            for h in stored:
                was.pop(h, None)
        for h in evicted:
            was[h] = None
        for _ in range(len(was) - self._evicted_limit):
            was.popitem(last=False)
