"""In-memory prefix index: the embedded default, and the Redis backend's local view.

Choose it for one gateway process (`demo`, single replica); with several replicas use
`RedisPrefixIndex`, which keeps one of these as its local view.

Data layout:
- memory tier: `hash -> bitmask of worker slots` (one int per block) plus `worker ->
  set of hashes` (to drop a worker in O(its blocks)). A lookup walks the prompt's
  hashes once, AND-ing the candidates' bitmask with each block's holders, and stops
  when no candidate is left: O(longest cached prefix among the candidates), not
  O(blocks x workers). Measured: ~0.2 ms for a fully cached 1,024-block prompt over 64
  candidates, 1M indexed blocks.
- store tier: `OrderedDict[hash, expires_at]` in write order (a re-store moves the entry
  to the end). Expired entries never count; they are purged from the front on every
  `apply` (bounded work) and by the cap.

Bounded memory (measured: ~105 B per memory-tier block and ~116 B per store block, plus
the 32-byte int of each hash):
- `max_blocks_per_worker` (default 2**20): a worker that reports more stored blocks than
  this loses arbitrary entries (set.pop). Events normally keep a worker far below it
  (its real capacity); the cap guards against a buggy or hostile worker.
- `max_store_blocks` (default 4,000,000): the least recently written store entries go
  first.

All work is synchronous inside the async methods (no awaits), so each call is atomic
with respect to other tasks on the event loop.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import Any

from deepinfer_gateway.core.protocol import KvEvent, KvEventBatch, KvEventKind, KvTier
from deepinfer_gateway.kvcache.types import DEFAULT_STORE_TTL_S, Overlap

FRESH = -1  # cursor state: epoch known, nothing applied; accepts the worker's oldest retained event
_PURGE_PER_APPLY = 1024
_BITS = [tuple(bit for bit in range(8) if byte >> bit & 1) for byte in range(256)]  # set bits of each byte


@dataclass(slots=True)
class Cursor:
    epoch: str
    last_seq: int = FRESH

    @property
    def poll_after(self) -> int:
        return 0 if self.last_seq == FRESH else self.last_seq


def accepts(last_seq: int, seq: int, oldest_seq: int) -> bool:
    """May event `seq` be applied next? (The Redis apply script mirrors this rule.)"""
    if last_seq == FRESH:
        return seq == 1 or seq == oldest_seq
    return seq == last_seq + 1


class InMemoryPrefixIndex:
    def __init__(
        self,
        *,
        max_blocks_per_worker: int = 1 << 20,
        max_store_blocks: int = 4_000_000,
        default_store_ttl_s: float = DEFAULT_STORE_TTL_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.max_blocks_per_worker = max_blocks_per_worker
        self.max_store_blocks = max_store_blocks
        self.default_store_ttl_s = default_store_ttl_s
        self._clock = clock
        self._holders: dict[int, int] = {}
        self._blocks: dict[str, set[int]] = {}
        self._slot: dict[str, int] = {}
        self._worker_at: dict[int, str] = {}
        self._free_slots: list[int] = []
        self._slots_version = 0  # bumped when a worker gets or loses a slot
        # The last lookup's (slots version, formats, workers, their order, slot mask per format,
        # zero hits per worker): a router looks up over the same ~1,000 workers request after request.
        self._masks: tuple[int, tuple[str, ...], dict[str, str], tuple[str, ...], dict[str, int],
                           dict[str, int]] | None = None
        self._cursors: dict[str, Cursor] = {}
        self._store: OrderedDict[int, float] = OrderedDict()

    # --- PrefixIndex ----------------------------------------------------------------

    async def apply(self, worker_id: str, batch: KvEventBatch) -> int:
        return self.apply_now(worker_id, batch)

    async def remove_worker(self, worker_id: str) -> None:
        self.drop_memory(worker_id)
        self._cursors.pop(worker_id, None)
        slot = self._slot.pop(worker_id, None)
        if slot is not None:
            del self._worker_at[slot]
            self._free_slots.append(slot)
            self._slots_version += 1

    async def lookup(self, hashes: Mapping[str, Sequence[int]], workers: Mapping[str, str]) -> Overlap:
        return self.lookup_now(hashes, workers)

    async def aclose(self) -> None:
        return None

    # --- synchronous core (also used by the Redis backend's local view) ---------------

    def apply_now(self, worker_id: str, batch: KvEventBatch) -> int:
        cur = self._cursors.get(worker_id)
        if cur is None or cur.epoch != batch.epoch:
            self.drop_memory(worker_id)
            cur = self._cursors[worker_id] = Cursor(batch.epoch)
        elif cur.last_seq != FRESH and batch.oldest_seq > cur.last_seq + 1:
            self._resync(worker_id, cur)  # fell behind the worker's retained log
        for event in batch.events:
            if cur.last_seq != FRESH and event.seq <= cur.last_seq:
                continue  # already applied (overlapping polls)
            if not accepts(cur.last_seq, event.seq, batch.oldest_seq):
                self._resync(worker_id, cur)
                if not accepts(cur.last_seq, event.seq, batch.oldest_seq):
                    return 0  # re-read from the worker's oldest retained event
            self._apply_event(worker_id, event)
            cur.last_seq = event.seq
        self._purge_expired()
        return cur.poll_after

    def lookup_now(self, hashes: Mapping[str, Sequence[int]], workers: Mapping[str, str]) -> Overlap:
        masks, zeros = self._format_masks(hashes, workers)
        memory = zeros.copy()  # dict.fromkeys(workers, 0), copied: no hashing of ~1,000 ids
        store = {fmt: self._store_leading(hs) for fmt, hs in hashes.items()}
        for fmt, mask in masks.items():
            self._memory_leading(hashes[fmt], mask, memory)
        return Overlap(memory=memory, store=store)

    def _format_masks(self, hashes: Mapping[str, Sequence[int]],
                      workers: Mapping[str, str]) -> tuple[dict[str, int], dict[str, int]]:
        """Per KV format among `hashes`, the slot mask of the `workers` of that format; and
        `dict.fromkeys(workers, 0)`."""
        formats = tuple(hashes)
        order = tuple(workers)
        last = self._masks
        if (last is not None and last[0] == self._slots_version and last[1] == formats and last[2] == workers
                and last[3] == order):
            return last[4], last[5]
        by_format: dict[str, int] = {}
        for worker_id, fmt in workers.items():
            slot = self._slot.get(worker_id)
            if slot is not None and fmt in hashes:
                by_format[fmt] = by_format.get(fmt, 0) | (1 << slot)
        zeros = dict.fromkeys(order, 0)
        self._masks = (self._slots_version, formats, dict(workers), order, by_format, zeros)
        return by_format, zeros

    async def stats(self) -> dict[str, Any]:
        return self.stats_now()

    def stats_now(self) -> dict[str, Any]:
        workers = {
            w: {"memory_blocks": len(self._blocks.get(w, ())), "epoch": cur.epoch, "last_seq": cur.last_seq}
            for w, cur in self._cursors.items()
        }
        # Expired store entries count until the next purge: counting live ones is O(entries).
        return {"backend": "memory", "workers": workers, "store_entries": len(self._store)}

    def drop_memory(self, worker_id: str) -> None:
        blocks = self._blocks.pop(worker_id, None)
        slot = self._slot.get(worker_id)
        if not blocks or slot is None:
            return
        clear = ~(1 << slot)
        holders = self._holders
        for h in blocks:
            mask = holders.get(h, 0) & clear
            if mask:
                holders[h] = mask
            else:
                holders.pop(h, None)

    def cursor(self, worker_id: str) -> Cursor | None:
        return self._cursors.get(worker_id)

    def workers(self) -> list[str]:
        return list(self._cursors)

    def memory_blocks(self, worker_id: str) -> set[int]:
        return set(self._blocks.get(worker_id, ()))

    def store_items(self) -> list[tuple[int, float]]:
        now = self._clock()
        return [(h, exp) for h, exp in self._store.items() if exp > now]

    # --- internals ----------------------------------------------------------------------

    def _resync(self, worker_id: str, cur: Cursor) -> None:
        self.drop_memory(worker_id)
        cur.last_seq = FRESH

    def _apply_event(self, worker_id: str, event: KvEvent) -> None:
        if event.tier is KvTier.MEMORY:
            if event.kind is KvEventKind.STORED:
                self._memory_add(worker_id, event.block_hashes)
            elif event.kind is KvEventKind.EVICTED:
                self._memory_remove(worker_id, event.block_hashes)
            else:
                self.drop_memory(worker_id)
        elif event.kind is KvEventKind.STORED:
            expires_at = event.expires_at if event.expires_at is not None else self._clock() + self.default_store_ttl_s
            self.store_add(event.block_hashes, expires_at)
        elif event.kind is KvEventKind.EVICTED:
            for h in event.block_hashes:
                self._store.pop(h, None)
        else:
            # The store is shared: `cleared` means it was wiped (for this worker's format,
            # but hashes do not say which): drop it all; under-prediction self-heals.
            self._store.clear()

    def _slot_for(self, worker_id: str) -> int:
        slot = self._slot.get(worker_id)
        if slot is None:
            slot = self._free_slots.pop() if self._free_slots else len(self._slot)
            self._slot[worker_id] = slot
            self._worker_at[slot] = worker_id
            self._slots_version += 1
        return slot

    def _memory_add(self, worker_id: str, hashes: Iterable[int]) -> None:
        bit = 1 << self._slot_for(worker_id)
        blocks = self._blocks.setdefault(worker_id, set())
        holders = self._holders
        for h in hashes:
            holders[h] = holders.get(h, 0) | bit
            blocks.add(h)
        excess = len(blocks) - self.max_blocks_per_worker
        if excess > 0:
            self._memory_remove(worker_id, [blocks.pop() for _ in range(excess)])

    def _memory_remove(self, worker_id: str, hashes: Iterable[int]) -> None:
        slot = self._slot.get(worker_id)
        if slot is None:
            return
        clear = ~(1 << slot)
        blocks = self._blocks.get(worker_id, set())
        holders = self._holders
        for h in hashes:
            blocks.discard(h)
            mask = holders.get(h, 0) & clear
            if mask:
                holders[h] = mask
            else:
                holders.pop(h, None)

    def store_add(self, hashes: Iterable[int], expires_at: float) -> None:
        store = self._store
        for h in hashes:
            store[h] = expires_at
            store.move_to_end(h)
        while len(store) > self.max_store_blocks:
            store.popitem(last=False)

    def _purge_expired(self) -> None:
        store = self._store
        now = self._clock()
        for _ in range(_PURGE_PER_APPLY):
            if not store:
                return
            h, exp = next(iter(store.items()))
            if exp > now:
                return
            del store[h]

    def _store_leading(self, hashes: Sequence[int]) -> int:
        now = self._clock()
        get = self._store.get
        n = 0
        for h in hashes:
            exp = get(h)
            if exp is None or exp <= now:
                break
            n += 1
        return n

    def _memory_leading(self, hashes: Sequence[int], alive: int, out: dict[str, int]) -> None:
        get = self._holders.get
        for i, h in enumerate(hashes):
            still = alive & get(h, 0)
            if still != alive:
                self._record(alive & ~still, i, out)
                alive = still
                if not alive:
                    return
        self._record(alive, len(hashes), out)

    def _record(self, mask: int, blocks: int, out: dict[str, int]) -> None:
        if not blocks:
            return  # `out` starts at 0 for every candidate
        # Set bits by byte (a fleet drops hundreds of workers at one block): no big-int
        # arithmetic per worker.
        data = mask.to_bytes((mask.bit_length() + 7) // 8, "little")
        slots = [base + bit for base, byte in zip(range(0, 8 * len(data), 8), data, strict=True) if byte
                 for bit in _BITS[byte]]
        out.update(zip(map(self._worker_at.__getitem__, slots), repeat(blocks)))
