"""The routers' fair-share exchange through Redis (the policy: router/flow_share.py).

One hash per pool, `{dgw:flow:<pool>}`, with a field per router (a random id per process): its
report, JSON, stamped with its wall clock. Every `interval_s` while this router has flow-control
traffic (requests waiting, or one admitted within `LINGER_S`) it writes its own report and reads
the others' in one round trip; idle, it costs nothing. Its last write, once its queues are empty,
tells the others it holds nothing. The state is volatile and rebuilds itself: a lost hash costs
one interval of per-router shares. Reports older than the stale bound are ignored, and deleted
past `FORGET_S`; the key expires `FORGET_S` after its last write. Redis errors leave each router
its own share (as without Redis), counted and logged once per outage.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from deepinfer_gateway.core.outage import Outage
from deepinfer_gateway.router.flow import FlowPolicy
from deepinfer_gateway.router.flow_share import STALE_INTERVALS, Report, SharedShare, decode, encode

log = logging.getLogger(__name__)

LINGER_S = 2.0  # keep exchanging this long after the last admission
FORGET_S = 30.0  # a report this old is deleted (its router is gone)


def share_key(pool: str) -> str:
    return "{dgw:flow:" + pool + "}"


class FlowShareSync:
    """Every pool's `SharedShare` (`share_of`, for FlowPolicy) and their exchange."""

    def __init__(self, redis: Any, half_life_s: float, interval_s: float,
                 on_error: Callable[[], None] | None = None,
                 on_routers: Callable[[str, int], None] | None = None) -> None:
        """`on_routers(pool, n)`: how many other routers' fresh reports a sync heard."""
        self._redis = redis
        self.policy: FlowPolicy | None = None  # the queues reported: the policy built with `share_of`
        self.shares: dict[str, SharedShare] = {}
        self.half_life_s = half_life_s
        self.interval_s = interval_s
        self.router_id = uuid.uuid4().hex
        self._on_routers = on_routers
        self._outage = Outage("flow control's shared fair share", "keeping this router's own share", on_error)
        self._admitted_at = -LINGER_S
        self._task: asyncio.Task[None] | None = None

    def share_of(self, pool: str) -> SharedShare:
        share = self.shares.get(pool)
        if share is None:
            share = self.shares[pool] = SharedShare(self.half_life_s, STALE_INTERVALS * self.interval_s)
        return share

    def admitted(self, now: float) -> None:
        """A request came under flow control (`now`: the loop's clock): exchange while traffic lasts."""
        self._admitted_at = now
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="flow-share")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                waiting = self.policy is not None and self.policy.waiting_pools()
                active = bool(waiting) or loop.time() - self._admitted_at < LINGER_S
                await self.sync()
                if not active:
                    return  # that sync said this router holds nothing
                await asyncio.sleep(self.interval_s)
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug here must not stop flow control: each router keeps its own share
            log.exception("flow control's shared fair share failed; this router keeps its own share")
        finally:
            self._task = None

    async def sync(self) -> None:
        """Write this router's report of every pool and read the others'."""
        policy = self.policy
        if policy is None or not self.shares or not self._outage.due():
            return
        pools = [(name, share, policy.pool(name)) for name, share in self.shares.items()]
        now, wall = asyncio.get_running_loop().time(), time.time()
        forget_ms = int(FORGET_S * 1000)
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                for name, share, queue in pools:
                    key = share_key(name)
                    pipe.hset(key, self.router_id, encode(share.report(queue.queued_by_tenant(), now, wall)))
                    pipe.pexpire(key, forget_ms)
                    pipe.hgetall(key)
                replies = await pipe.execute()
            stale: list[tuple[str, Any]] = []
            for (name, share, _), fields in zip(pools, replies[2::3], strict=True):
                reports = self._others(fields, now, wall, stale, name)
                share.heard([r for r in reports if now - r.at <= share.stale_s])
                if self._on_routers is not None:
                    self._on_routers(name, len(share.others))
            if stale:
                async with self._redis.pipeline(transaction=False) as pipe:
                    for name, router in stale:
                        pipe.hdel(share_key(name), router)
                    await pipe.execute()
        except Exception as exc:  # any Redis failure: each router's own share
            self._outage.failed(exc)
            for _, share, _ in pools:
                share.heard([])
            return
        self._outage.ok()

    def _others(self, fields: dict[Any, Any], now: float, wall: float, stale: list[tuple[str, Any]],
                pool: str) -> list[Report]:
        reports = []
        for router, text in fields.items():
            if router in (self.router_id, self.router_id.encode()):
                continue
            report = decode(text, now, wall)
            if report is None or now - report.at > FORGET_S:
                stale.append((pool, router))
            else:
                reports.append(report)
        return reports
