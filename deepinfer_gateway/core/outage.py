"""Degrade-don't-fail bookkeeping for optional shared state (Redis): count every failed
call, log once when an outage starts and once when it ends, and keep the request path off
a Redis that failed.

While an outage lasts, `due()` says False except once per `retry_interval_s` (a probe), so
the caller takes its fallback at once. A Redis that refuses connections fails fast anyway,
but one that hangs (a failover, a node gone from the network, a stalled server) costs every
call its socket timeout: without this, every request of a gateway would wait that long per
Redis user on its path. The prefix index keeps its own schedule (kvcache/redis_index.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


class Outage:
    def __init__(self, component: str, fallback: str, on_error: Callable[[], None] | None = None,
                 retry_interval_s: float = 1.0, clock: Callable[[], float] = time.monotonic):
        self.component = component
        self.fallback = fallback  # what the component does meanwhile, for the log line
        self._on_error = on_error
        self.retry_interval_s = retry_interval_s
        self._clock = clock
        self._retry_at = 0.0
        self.active = False

    def due(self) -> bool:
        """Whether to call Redis now: always outside an outage; during one, once per interval."""
        if not self.active:
            return True
        now = self._clock()
        if now < self._retry_at:
            return False
        self._retry_at = now + self.retry_interval_s  # one probe; the others keep the fallback
        return True

    def failed(self, exc: Exception) -> None:
        if self._on_error is not None:
            self._on_error()
        if not self.active:
            log.warning("%s: Redis unavailable (%s); %s until it returns", self.component, exc, self.fallback)
        self.active = True
        self._retry_at = self._clock() + self.retry_interval_s

    def ok(self) -> None:
        if self.active:
            log.info("%s: Redis is back", self.component)
        self.active = False
