"""How late this process's event loop runs, and whether a timed-out worker call was the
worker's fault or this gateway's own stall.

A timer callback every `interval_s` notes how late it ran (`dgw_event_loop_lag_seconds`).
A loop that stops for a while (CPU starved by a noisy neighbour, a long synchronous
step) makes every timeout armed before the stall fire when it resumes, before the I/O that
completed meanwhile is read: uvloop (libuv) runs expired timers before it polls for I/O. A
2 s worker connect timeout then fires for connections the kernel accepted long ago. Counted
as worker failures, such timeouts eject healthy workers two at a time, herd the traffic
onto the rest and back off the KV event feeds: one stall of the gateway becomes seconds of
tail on every worker. `own_stall_s(since)` tells how long the loop was held up since a
call began, so the caller can leave it out of a worker's health.

The timer runs only while there is something to judge: `busy()` (the registry: health checks
and requests in flight) or a call that began (`now()`) within the last `idle_after_s`. An idle gateway's loop
then has no timer of its own; the next `now()` starts it again, one interval before its first
tick, so a stall during any call that asked for `now()` is seen as before. What an idle
stretch misses is a stall while nothing waited on a worker, which no timeout can hit.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

from prometheus_client import Histogram

LAG_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_KEEP_TICKS = 1200  # lateness of the last ~2 minutes at 10 ticks per second


class LoopLag:
    """Lateness of a periodic timer on the running loop. `start()` inside the loop."""

    def __init__(self, interval_s: float = 0.1, histogram: Histogram | None = None, idle_after_s: float = 1.0):
        self.interval_s = interval_s
        self.idle_after_s = idle_after_s
        self.busy: Callable[[], bool] = lambda: False  # work in flight whose timeouts may be judged
        self._histogram = histogram
        self._running = False
        self._last_call = 0.0  # loop time of the last `now()`
        self._ticks: deque[tuple[float, float]] = deque(maxlen=_KEEP_TICKS)  # (ran at, seconds late)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._due = 0.0

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._running = True
        self._last_call = self._loop.time()
        self._schedule(self._last_call)

    def stop(self) -> None:
        self._running = False
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _schedule(self, now: float) -> None:
        assert self._loop is not None
        self._due = now + self.interval_s
        self._handle = self._loop.call_at(self._due, self._tick)

    def _tick(self) -> None:
        assert self._loop is not None
        now = self._loop.time()
        late = max(0.0, now - self._due)
        self._ticks.append((now, late))
        if self._histogram is not None:
            self._histogram.observe(late)
        if now - self._last_call < self.idle_after_s or self.busy():
            self._schedule(now)
        else:
            self._handle = None  # idle: the next `now()` wakes it

    def now(self) -> float:
        """The loop's clock (what `since` arguments are read on); 0 before `start`. A call
        about to wait on it: the timer runs (again) from here."""
        loop = self._loop
        if loop is None:
            return 0.0
        now = self._last_call = loop.time()
        if self._handle is None and self._running:
            self._schedule(now)
        return now

    def own_stall_s(self, since: float) -> float:
        """Seconds the loop was held up after `since` (loop time): the lateness of the ticks
        that ran since, plus that of a tick overdue now."""
        if self._loop is None:
            return 0.0
        held = sum(late for ran, late in reversed(self._ticks) if ran > since) if self._ticks else 0.0
        return held + max(0.0, self._loop.time() - self._due) if self._handle is not None else held

    def blames_self(self, since: float) -> bool:
        """Did this process's own stall take at least a quarter of the time since `since`? Then a
        timeout over that span says nothing about the worker."""
        if self._loop is None:
            return False
        elapsed = self._loop.time() - since
        return elapsed > 0 and self.own_stall_s(since) >= 0.25 * elapsed
