"""KV event log: gap-free sequence numbers per epoch, bounded retention, thread-safe.

Appended from the step thread, read by the worker server's event loop. A consumer that
falls behind the retained window sees `oldest_seq - 1 > after` and resyncs (protocol).
"""

from __future__ import annotations

import threading
import uuid
from collections import deque
from itertools import islice

from deepinfer_gateway.protocol import KvEvent, KvEventBatch, KvEventKind, KvTier


class KvEventLog:
    def __init__(self, worker_id: str, retain: int = 100_000) -> None:
        self._worker_id = worker_id
        self._retain = retain
        self._lock = threading.Lock()
        self._events: deque[KvEvent] = deque(maxlen=retain)
        self._last_seq = 0
        self.epoch = ""

    def restart(self) -> str:
        """New epoch, seq restarts at 1 with `cleared` for the memory tier (the engine's
        HBM is empty after a start; the shared store tier survives restarts)."""
        with self._lock:
            self.epoch = uuid.uuid4().hex
            self._events.clear()
            self._last_seq = 0
        self.append(KvEventKind.CLEARED, KvTier.MEMORY, [])
        return self.epoch

    def append(self, kind: KvEventKind, tier: KvTier, block_hashes: list[int], expires_at: float | None = None) -> None:
        with self._lock:
            self._last_seq += 1
            self._events.append(
                KvEvent(seq=self._last_seq, kind=kind, tier=tier, block_hashes=block_hashes, expires_at=expires_at)
            )

    def batch(self, after: int, limit: int = 10_000) -> KvEventBatch:
        with self._lock:
            oldest = self._events[0].seq if self._events else self._last_seq + 1
            start = max(after + 1, oldest) - oldest  # index of the first event with seq > after
            events = list(islice(self._events, start, start + max(limit, 0)))
            return KvEventBatch(
                worker_id=self._worker_id, epoch=self.epoch, events=events, last_seq=self._last_seq, oldest_seq=oldest
            )
