"""A worker's KV event batches as its v2 connection pushes them (docs/worker-protocol.md "Pushes").

The hand-over between the connection (which reads the batches) and the feeder (which owns
the cursor and applies them, kvcache/events.py): the connection `attach`es a subscribe
function when it is up and pushing, `deliver`s each batch and `detach`es when it closes;
the feeder `subscribe`s from its cursor and reads batches with `next`, which answers None
when the connection it subscribed on is gone (the feeder then polls over HTTP again).

Each subscription has a number the worker echoes: a batch sent before the worker read a
newer subscription is stale and skipped, so a resubscription after a gap (the index asks
to re-read from another cursor) never applies a batch twice or out of order. A feeder that
falls more than MAX_QUEUED batches behind loses the queue and resubscribes from its cursor:
the worker's log still holds the events (or says where it no longer does).
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable

from deepinfer_gateway.core.protocol import KvEventBatch

MAX_QUEUED = 256

# (after, sub, interval_ms, limit) -> the op sent; False when the connection is already gone
Subscribe = Callable[[int, int, int, int], bool]


class KvPush:
    def __init__(self) -> None:
        self._subscribe: Subscribe | None = None
        self._generation = 0  # bumped at every attach and detach: a feeder's wait ends
        self._sub = 0
        self._batches: collections.deque[tuple[int, KvEventBatch]] = collections.deque()
        self._changed: asyncio.Event | None = None  # only while the feeder waits

    # -- the connection's side ----------------------------------------------------------

    def attach(self, subscribe: Subscribe) -> None:
        self._subscribe = subscribe
        self._moved()

    def detach(self, subscribe: Subscribe | None = None) -> None:
        """The connection closed (`subscribe`: only if it is still the attached one)."""
        if subscribe is None or subscribe == self._subscribe:
            self._subscribe = None
            self._moved()

    def deliver(self, sub: int, batch: KvEventBatch) -> None:
        if sub != self._sub:
            return  # sent before the worker read the newer subscription
        self._batches.append((sub, batch))
        if len(self._batches) > MAX_QUEUED:
            self._moved()  # the feeder resubscribes from its cursor
        else:
            self._wake()

    # -- the feeder's side --------------------------------------------------------------

    @property
    def live(self) -> bool:
        return self._subscribe is not None

    @property
    def generation(self) -> int:
        return self._generation

    def subscribe(self, after: int, interval_s: float, limit: int) -> bool:
        """Ask for batches from `after` on; False when no connection is up to ask."""
        self._sub += 1
        self._batches.clear()
        subscribe = self._subscribe
        return subscribe is not None and subscribe(after, self._sub, round(interval_s * 1000), limit)

    async def next(self, generation: int) -> KvEventBatch | None:
        """The next batch of the current subscription; None once `generation` is over
        (the connection closed or was replaced, or the queue overflowed)."""
        while True:
            if self._generation != generation or self._subscribe is None:
                return None
            if self._batches:
                return self._batches.popleft()[1]
            self._changed = changed = self._changed or asyncio.Event()
            await changed.wait()

    def _moved(self) -> None:
        self._generation += 1
        self._batches.clear()
        self._wake()

    def _wake(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = None
