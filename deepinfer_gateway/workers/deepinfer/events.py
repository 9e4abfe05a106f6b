"""KV event log: gap-free sequence numbers per epoch, bounded retention, thread-safe.

Appended from the step thread, read by the worker server's event loop. A consumer that
falls behind the retained window sees `oldest_seq - 1 > after` and resyncs (protocol).
`wait_past` long-polls: the first append (or restart) after a reader started waiting
wakes it through `call_soon_threadsafe`, once per wait, not once per event.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import uuid
from collections import deque
from itertools import islice

from deepinfer_gateway.core.protocol import KvEvent, KvEventBatch, KvEventKind, KvTier


class KvEventLog:
    def __init__(self, worker_id: str, retain: int = 100_000) -> None:
        self._worker_id = worker_id
        self._retain = retain
        self._lock = threading.Lock()
        self._events: deque[KvEvent] = deque(maxlen=retain)
        self._last_seq = 0
        self.epoch = ""
        # (loop, event) the next append sets; only while a reader waits. Guarded by _lock.
        self._appended: tuple[asyncio.AbstractEventLoop, asyncio.Event] | None = None

    def restart(self) -> str:
        """New epoch, seq restarts at 1 with `cleared` for the memory tier (the engine's
        HBM is empty after a start; the shared store tier survives restarts)."""
        with self._lock:
            self.epoch = uuid.uuid4().hex
            self._events.clear()
            self._last_seq = 0
            self._wake_readers()
        self.append(KvEventKind.CLEARED, KvTier.MEMORY, [])
        return self.epoch

    def append(self, kind: KvEventKind, tier: KvTier, block_hashes: list[int], expires_at: float | None = None) -> None:
        with self._lock:
            self._last_seq += 1
            self._events.append(
                KvEvent(seq=self._last_seq, kind=kind, tier=tier, block_hashes=block_hashes, expires_at=expires_at)
            )
            self._wake_readers()

    def _wake_readers(self) -> None:
        """Under _lock: set the waiting readers' event from whichever thread appended."""
        if self._appended is None:
            return
        loop, event = self._appended
        self._appended = None
        if not loop.is_closed():
            loop.call_soon_threadsafe(event.set)

    async def wait_past(self, after: int, timeout_s: float) -> None:
        """Return once `last_seq != after` (events past the cursor, or a cursor from
        another epoch) or after `timeout_s`, whichever comes first."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                while True:
                    with self._lock:
                        if self._last_seq != after:
                            return
                        if self._appended is None:
                            self._appended = (asyncio.get_running_loop(), asyncio.Event())
                        event = self._appended[1]
                    await event.wait()

    def batch(self, after: int, limit: int = 10_000) -> KvEventBatch:
        with self._lock:
            oldest = self._events[0].seq if self._events else self._last_seq + 1
            start = max(after + 1, oldest) - oldest  # index of the first event with seq > after
            events = list(islice(self._events, start, start + max(limit, 0)))
            return KvEventBatch(
                worker_id=self._worker_id, epoch=self.epoch, events=events, last_seq=self._last_seq, oldest_seq=oldest
            )
