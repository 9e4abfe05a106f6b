"""Flow control on the request path: requests wait here while their pool is saturated.

The policy is router/flow.py's (pure); this module gives it a clock, the load views and
waiters. A request whose pool can start it passes at once (its pool's queue is empty and a
worker is under the saturation bounds: one look at the views it was planned on). Otherwise
it waits on a future that one pump task resolves: woken when a request arrives or a leg ends,
and every `TICK_S` while anything waits (load reports arrive on the health interval; the
deadlines expire on the clock). The pump reads the views afresh each pass, so bookings of the
requests it just started count before the next pass.

A request started here holds its prompt tokens as "granted" in its pool's load until its leg
is booked on a worker (`Grant.booked`): the views cannot show it before that; it counts
as starting until its first token (`Grant.started`); and it holds one of its pool's sequence
slots until its first leg ends (`Grant.ended`): counted for flex against its share, for the
tiers above in their recent peak (`flex_yield_window_ms`).
A client that disconnects while queued cancels its waiter: it leaves the queue at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from deepinfer_gateway.config import FlowControlSettings
from deepinfer_gateway.core.errors import Overloaded
from deepinfer_gateway.gateway.serving.flow_share_sync import FlowShareSync
from deepinfer_gateway.gateway.telemetry.metrics import GatewayMetrics
from deepinfer_gateway.router.flow import (
    FlowLimits,
    FlowPolicy,
    FlowRequest,
    Holds,
    PoolLoad,
    Shed,
    ShedReason,
    Tier,
    can_start_now,
    retry_after,
)
from deepinfer_gateway.router.worker_view import WorkerView

log = logging.getLogger(__name__)

TICK_S = 0.02


@dataclass(frozen=True)
class FlowTicket:
    """What the route decided of a request's flow: its tier, tenant, weight and TTFT target."""

    tier: Tier
    tenant: str
    weight: float
    target_s: float
    expected_output: int  # tokens counted in the fair share besides the prompt


class Grant:
    """A request's permission to be placed: `booked` once its leg is booked on a worker, `started`
    once it has its first token or failed, `ended` once its first leg ended or it failed (each
    idempotent; `ended` implies `started`, which implies `booked`)."""

    __slots__ = ("_gate", "_holder", "_booked", "tier", "pool", "tokens", "waited_s")

    def __init__(self, gate: FlowGate | None, pool: str, tokens: int, waited_s: float, tier: Tier = Tier.DEFAULT
                 ) -> None:
        self._gate, self.pool, self.tokens, self.waited_s, self.tier = gate, pool, tokens, waited_s, tier
        self._holder = gate
        self._booked = False

    def booked(self) -> None:
        if self._gate is not None and not self._booked:
            self._booked = True
            self._gate.granted[self.pool] -= self.tokens

    def started(self) -> None:
        gate = self._gate
        if gate is not None:
            self.booked()
            self._gate = None
            gate.holds.started(self.pool, self.tier)
            gate.wake()

    def ended(self) -> None:
        self.started()
        holder = self._holder
        if holder is not None:
            self._holder = None
            holder.release_slot(self.pool, self.tier)


class _Speeds(dict[str, float]):
    def __init__(self, speed_of: Callable[[str], float]) -> None:
        super().__init__()
        self._speed_of = speed_of

    def __missing__(self, hardware: str) -> float:
        speed = self[hardware] = self._speed_of(hardware)
        return speed


class FlowGate:
    """One per process: every pool's queue and the pump that starts its requests."""

    def __init__(self, settings: FlowControlSettings, views: Callable[[], Awaitable[list[WorkerView]]],
                 speed_of: Callable[[str], float], metrics: GatewayMetrics, sends_priority: bool = True,
                 redis: Any = None) -> None:
        """`sends_priority`: this router's requests reach the engines with their tier as the engine's
        priority (the gateway's do; the EPP's carry the client's own body), so a pool whose workers
        preempt lets the tiers above flex past flex's load; without it no pool counts as preempting.
        `redis`: the routers sharing it keep one fair share (`shared_share`, flow_share_sync.py)."""
        self.settings = settings
        self.sends_priority = sends_priority
        self.exchange = (FlowShareSync(redis, settings.share_half_life_ms / 1000.0, settings.share_interval_ms / 1000.0,
                                       metrics.redis_errors.labels("flow").inc,
                                       lambda pool, n: metrics.flow_routers.labels(pool).set(n))
                         if redis is not None and settings.shared_share else None)
        self.policy = FlowPolicy(FlowLimits.of(settings),
                                 self.exchange.share_of if self.exchange is not None else None)
        if self.exchange is not None:
            self.exchange.policy = self.policy
        self._views = views
        self.speeds = _Speeds(speed_of)
        self.metrics = metrics
        self.granted: defaultdict[str, int] = defaultdict(int)  # tokens of started requests not yet booked
        self.holds = Holds(self.policy.limits)  # started requests: starting, then holding a slot
        self._wake = asyncio.Event()
        self._wait_series: dict[tuple[str, Tier], Any] = {}
        self._pump_task: asyncio.Task[None] | None = None

    async def close(self) -> None:
        if self.exchange is not None:
            await self.exchange.close()

    def wake(self) -> None:
        """Something changed (a leg ended): look again at once if anything waits."""
        if self._pump_task is not None:
            self._wake.set()

    async def admit(self, ticket: FlowTicket, prompt_tokens: int, pool: str, views: Sequence[WorkerView],
                    arrival: float) -> Grant:
        """Wait until `pool` can start the request (`views`: what it was planned on); Overloaded
        (429 + Retry-After) when it cannot start before its deadline or the queue is full."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        views = self._as_seen(views)
        waited_before = time.perf_counter() - arrival  # preparation already spent part of the target
        request = FlowRequest(ticket.tenant, ticket.tier, prompt_tokens, prompt_tokens + ticket.expected_output,
                              now, now + max(0.0, ticket.target_s - waited_before), ticket.weight)
        queue = self.policy.pool(pool)
        if self.exchange is not None:  # after the pool's share exists: the first exchange reports it
            await self.exchange.admitted(now)
            now = loop.time()
        holds = self.holds
        flex = holds.flex.get(pool, 0) if ticket.tier is Tier.FLEX else 0
        others_peak = holds.others_peak(pool, time.monotonic()) if flex else 0
        if not queue.ahead_of(ticket.tier, now) and can_start_now(
                views, pool, self.speeds, self.policy.limits, self.granted[pool], holds.starting.get(pool, 0),
                ticket.tier, flex, others_peak, holds.starting_above.get(pool, 0), holds.above.get(pool, 0)):
            queue.served(request, now)
            return self._grant(pool, request, 0.0)  # not saturated: the common case, kept cheap
        load = self._load(views, pool)
        outcome = queue.arrive(request, load, now)
        for displaced in outcome.displaced:
            self._refuse(pool, displaced, Shed(ShedReason.DISPLACED, retry_after(ticket.target_s)))
        if outcome.shed is not None:
            self._count_shed(pool, request, outcome.shed)
            raise self._overloaded(pool, request, outcome.shed)
        if outcome.start:
            return self._grant(pool, request, 0.0)
        future: asyncio.Future[Grant] = loop.create_future()
        request.handle = future
        self._gauge(pool)
        if self._pump_task is None:
            self._pump_task = asyncio.create_task(self._pump(), name="flow-control")
        self._wake.set()
        try:
            return await future
        except asyncio.CancelledError:
            if queue.remove(request):  # its client left while it waited
                self._gauge(pool)
            elif future.done() and not future.cancelled() and future.exception() is None:
                future.result().ended()  # started, then cancelled before it was placed
            raise

    def _as_seen(self, views: Sequence[WorkerView]) -> Sequence[WorkerView]:
        """The views as flow control may take them: a worker preempts for this router's requests
        only if they carry their tier as its priority."""
        if self.sends_priority or not any(v.preempts for v in views):
            return views
        return [replace(v, preempts=False) if v.preempts else v for v in views]

    def _grant(self, pool: str, request: FlowRequest, waited_s: float) -> Grant:
        self.granted[pool] += request.prompt_tokens
        self.holds.take(pool, request.tier, time.monotonic())
        series = self._wait_series.get((pool, request.tier))
        if series is None:  # a labels() lookup costs more than the rest of an unsaturated admission
            series = self._wait_series[pool, request.tier] = self.metrics.flow_wait.labels(pool, request.tier.label)
        series.observe(waited_s)
        return Grant(self, pool, request.prompt_tokens, waited_s, request.tier)

    def release_slot(self, pool: str, tier: Tier) -> None:
        self.holds.release(pool, tier, time.monotonic())
        self.wake()

    def _load(self, views: Sequence[WorkerView], pool: str) -> PoolLoad:
        return self.holds.load(views, pool, self.speeds, time.monotonic(), self.granted[pool])

    def _overloaded(self, pool: str, request: FlowRequest, shed: Shed) -> Overloaded:
        why = {ShedReason.DEADLINE: "cannot start within its time-to-first-token target",
               ShedReason.QUEUE_FULL: "found the pool's queue full",
               ShedReason.TENANT_FULL: "found its tenant's share of the pool's queue full",
               ShedReason.DISPLACED: "gave way to a request of a higher service tier"}[shed.reason]
        return Overloaded(f"Pool {pool} is saturated: this {request.tier.label} request {why}; retry later.",
                          headers={"retry-after": str(shed.retry_after_s)})

    def _count_shed(self, pool: str, request: FlowRequest, shed: Shed) -> None:
        self.metrics.flow_shed.labels(pool, request.tier.label, shed.reason).inc()

    def _refuse(self, pool: str, request: FlowRequest, shed: Shed) -> None:
        self._count_shed(pool, request, shed)
        future = request.handle
        if isinstance(future, asyncio.Future) and not future.done():
            future.set_exception(self._overloaded(pool, request, shed))

    def _gauge(self, pool: str) -> None:
        queue = self.policy.pool(pool)
        for tier in Tier:
            self.metrics.flow_queued.labels(pool, tier.label).set(queue.depth(tier))

    async def _pump(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while pools := self.policy.waiting_pools():
                self._wake.clear()
                views = self._as_seen(await self._views())
                now = loop.time()
                for pool in pools:
                    queue = self.policy.pool(pool)
                    load = self._load(views, pool)
                    for late in queue.expired(now):
                        self._refuse(pool, late, Shed(ShedReason.DEADLINE, retry_after(load.wait_past(
                            self.policy.limits) + 1.0)))
                        if late.starved:
                            self.metrics.flow_starved.labels(pool, late.tier.label).inc()
                    for request in self.policy.starts(pool, load, now):
                        future = request.handle
                        if isinstance(future, asyncio.Future) and not future.done():
                            future.set_result(self._grant(pool, request, now - request.arrival))
                    self._gauge(pool)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), TICK_S)
        except Exception:
            log.exception("flow control pump failed; queued requests are refused")
            for pool in self.policy.waiting_pools():
                queue = self.policy.pool(pool)
                for band in queue.bands:
                    for _, _, request in list(band.heap):
                        if queue.remove(request):
                            self._refuse(pool, request, Shed(ShedReason.QUEUE_FULL, 1))
                self._gauge(pool)
        finally:
            self._pump_task = None
