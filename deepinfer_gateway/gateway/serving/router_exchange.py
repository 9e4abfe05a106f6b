"""Routers' periodic reports to each other through Redis: what the replicas (gateway replicas,
`serve --processes` processes, EPPs) share of state that is each one's own (flow control's fair
share, sessions' cache capacity).

One hash per key, a field per router (a random id per process): its report, prefixed with the
wall clock it was written at. Every `interval_s` while its owner is busy (`busy()`, or a
request within `LINGER_S` of `touched`), one Redis round trip writes this router's reports
(`collect`) and reads the others' (`hear`: the fresh ones, each with its age on this router's
clock); idle, it costs nothing. Its last write, once no longer busy, tells the others what it
holds then. A report older than `stale_s` (10 intervals) counts for nothing (its router died, or went idle);
past `FORGET_S` it is deleted, and a key expires `FORGET_S` after its last write. The state is
volatile and rebuilds itself within an interval. Redis errors leave each router on its own
state, counted and logged once per outage.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from deepinfer_gateway.core.outage import Outage

log = logging.getLogger(__name__)

LINGER_S = 2.0  # keep exchanging this long after the last request
STALE_INTERVALS = 10  # a report older than this many intervals counts for nothing
FORGET_S = 30.0  # a report this old is deleted (its router is gone)


@dataclass(frozen=True)
class Heard:
    """Another router's report: `at` on this router's clock."""

    at: float
    text: str


class RouterExchange:
    def __init__(self, redis: Any, component: str, interval_s: float,
                 collect: Callable[[float], dict[str, str]], hear: Callable[[str, list[Heard], float], None],
                 busy: Callable[[], bool], on_error: Callable[[], None] | None = None) -> None:
        """`collect(now)`: key -> this router's report; `hear(key, reports, now)`: the others' fresh
        reports of a key this router wrote (none while Redis fails); `now`: the loop's clock."""
        self._redis = redis
        self.interval_s = interval_s
        self.stale_s = STALE_INTERVALS * interval_s
        self._collect, self._hear, self._busy = collect, hear, busy
        self.router_id = uuid.uuid4().hex
        self._outage = Outage(component, "keeping this router's own state", on_error)
        self._touched_at = -math.inf
        self._task: asyncio.Task[None] | None = None
        self._synced = asyncio.Event()  # the running exchange has synced once

    async def touched(self, now: float) -> None:
        """A request came (`now`: the loop's clock): exchange while traffic lasts. The first request
        after an idle spell waits for the first exchange (at most an interval): an idle router
        holds nothing of the others' state."""
        self._touched_at = now
        if self._task is None:
            self._synced.clear()
            self._task = asyncio.get_running_loop().create_task(self._run(), name="router-exchange")
        if not self._synced.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._synced.wait(), self.interval_s)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                active = self._busy() or loop.time() - self._touched_at < LINGER_S
                await self.sync()
                self._synced.set()
                if not active:
                    return  # that sync said what this router holds idle
                await asyncio.sleep(self.interval_s)
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug here must not stop the requests: each router keeps its own state
            log.exception("%s: the exchange failed; this router keeps its own state", self._outage.component)
        finally:
            self._task = None
            self._synced.set()  # nothing to wait for: a request that finds no exchange starts one

    async def sync(self) -> None:
        """Write this router's reports and read the others'."""
        if not self._outage.due():
            return
        now, wall = asyncio.get_running_loop().time(), time.time()
        reports = self._collect(now)
        if not reports:
            return
        forget_ms = int(FORGET_S * 1000)
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                for key, text in reports.items():
                    pipe.hset(key, self.router_id, f"{wall:.3f} {text}")
                    pipe.pexpire(key, forget_ms)
                    pipe.hgetall(key)
                replies = await pipe.execute()
            gone: list[tuple[str, Any]] = []
            heard = {key: self._others(key, fields, now, wall, gone) for key, fields in zip(reports, replies[2::3],
                                                                                            strict=True)}
            if gone:
                async with self._redis.pipeline(transaction=False) as pipe:
                    for key, router in gone:
                        pipe.hdel(key, router)
                    await pipe.execute()
        except Exception as exc:  # any Redis failure: each router's own state
            self._outage.failed(exc)
            for key in reports:
                self._hear(key, [], now)
            return
        self._outage.ok()
        for key, others in heard.items():
            self._hear(key, others, now)

    def _others(self, key: str, fields: dict[Any, Any], now: float, wall: float, gone: list[tuple[str, Any]]
                ) -> list[Heard]:
        fresh = []
        for router, value in fields.items():
            if router in (self.router_id, self.router_id.encode()):
                continue
            text = value.decode() if isinstance(value, bytes) else str(value)
            stamp, _, body = text.partition(" ")
            try:
                age = wall - float(stamp)
            except ValueError:
                age = math.inf
            if not age <= FORGET_S:  # NaN and damaged stamps too
                gone.append((key, router))
            elif age <= self.stale_s:
                fresh.append(Heard(now - age, body))
        return fresh
