"""A worker's KV event log: what the prefix index learns about its blocks.

Events get gap-free sequence numbers from 1 within an epoch (a uuid fresh at every
start); the first event is `cleared` for the memory tier, so a consumer that sees a new
epoch drops everything it believed about this worker's memory. Retention is bounded: a
consumer that fell further behind than `oldest_seq` must resync (drop and rebuild from
the events still held). Events are kept as tuples and turned into pydantic models only
when read, because appends sit on the scheduler's hot path.

`wait_past` lets a reader long-poll: it returns at the next append (an asyncio.Event,
created only while someone waits, so an append costs one `is None` test otherwise).
Single-threaded: appends and waits run on the worker's event loop.

A real engine reports a block stored once the forward pass that computed it is over, while the
scheduler core computes a step's outcome when the step begins: between `hold` and `publish`
(the step's time passing) appends wait unnumbered and unseen, so no reader learns of a block
before the step that computes it has ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections import deque

from deepinfer_gateway.core.protocol import KvEvent, KvEventBatch, KvEventKind, KvTier

_Row = tuple[int, KvEventKind, KvTier, list[int], float | None]


class SimKvEventLog:
    def __init__(self, worker_id: str, retention: int = 100_000) -> None:
        self.worker_id = worker_id
        self.epoch = uuid.uuid4().hex
        self._rows: deque[_Row] = deque(maxlen=retention)
        self._last_seq = 0
        self._appended: asyncio.Event | None = None  # set by the next append; only while someone waits
        self._held: list[tuple[KvEventKind, KvTier, list[int], float | None]] | None = None  # hold() .. publish()
        self.append(KvEventKind.CLEARED, KvTier.MEMORY, [])

    @property
    def last_seq(self) -> int:
        return self._last_seq

    def append(self, kind: KvEventKind, tier: KvTier, hashes: list[int], expires_at: float | None = None) -> None:
        if not hashes and kind is not KvEventKind.CLEARED:
            return
        if self._held is not None:
            self._held.append((kind, tier, hashes, expires_at))
            return
        self._last_seq += 1
        self._rows.append((self._last_seq, kind, tier, hashes, expires_at))
        if self._appended is not None:
            self._appended.set()
            self._appended = None

    def hold(self) -> None:
        """A step begins: what it appends stays unseen until `publish` (module doc)."""
        if self._held is None:
            self._held = []

    def publish(self) -> None:
        """The step is over: what it appended becomes readable, in order."""
        held, self._held = self._held, None
        for row in held or ():
            self.append(*row)

    async def wait_past(self, after: int, timeout_s: float) -> None:
        """Return once `last_seq != after` (events past the cursor, or a cursor from
        another epoch) or after `timeout_s`, whichever comes first."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                while self._last_seq == after:
                    if self._appended is None:
                        self._appended = asyncio.Event()
                    await self._appended.wait()

    def batch(self, after: int, limit: int = 10_000) -> KvEventBatch:
        """Events with seq > after, oldest first, at most `limit`."""
        oldest = self._rows[0][0] if self._rows else self._last_seq + 1
        start = max(0, after + 1 - oldest)  # seqs are contiguous, so index arithmetic works
        end = min(len(self._rows), start + max(0, limit))
        # Built without validation: the rows hold exactly the models' types (ints, the enums, a
        # list of ints nobody changes once appended), and validating copies every hash list.
        construct = KvEvent.model_construct
        events = [
            construct(seq=seq, kind=kind, tier=tier, block_hashes=hashes,
                      expires_at=None if expires is None else float(expires))
            for seq, kind, tier, hashes, expires in (self._rows[i] for i in range(start, end))
        ]
        return KvEventBatch.model_construct(
            worker_id=self.worker_id, epoch=self.epoch, events=events, last_seq=self._last_seq, oldest_seq=oldest
        )
