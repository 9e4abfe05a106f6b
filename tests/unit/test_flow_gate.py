"""gateway/serving/flow_gate.py on the event loop: waiting, starting, leaving and expiring, over
views the test sets (the load view is plain data: router/worker_view.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from deepinfer_gateway.config import FlowControlSettings
from deepinfer_gateway.core.errors import Overloaded
from deepinfer_gateway.core.protocol import Role
from deepinfer_gateway.gateway.serving.flow_gate import FlowGate, FlowTicket
from deepinfer_gateway.gateway.telemetry.metrics import GatewayMetrics
from deepinfer_gateway.router.flow import Tier
from deepinfer_gateway.router.worker_view import WorkerView

SETTINGS = FlowControlSettings(enabled=True, max_engine_wait_ms=100, max_engine_waiting=2)


def view(queued: int) -> WorkerView:
    return WorkerView(worker_id="w", role=Role.UNIFIED, pool="p", hardware="sm100", kv_format="f", model="m",
                      queued_prefill_tokens=queued)


class Views:
    """The pool's load as the test sets it; the gate reads it as it reads RouteInputs.views."""

    def __init__(self, queued: int) -> None:
        self.now = [view(queued)]

    async def __call__(self) -> list[WorkerView]:
        return self.now


def ticket(tier: Tier = Tier.DEFAULT, target_s: float = 10.0, tenant: str = "a") -> FlowTicket:
    return FlowTicket(tier=tier, tenant=tenant, weight=1.0, target_s=target_s, expected_output=0)


def gate(views: Views) -> tuple[FlowGate, GatewayMetrics]:
    metrics = GatewayMetrics()
    return FlowGate(SETTINGS, views, lambda hardware: 10_000.0, metrics), metrics


def queued(metrics: GatewayMetrics, tier: str) -> float:
    return metrics.flow_queued.labels("p", tier)._value.get()


def test_unsaturated_passes_at_once_and_counts_as_starting_until_its_first_token() -> None:
    async def run() -> None:
        views = Views(0)
        g, _ = gate(views)
        grants = [await g.admit(ticket(), 100, "p", views.now, time.perf_counter()) for _ in range(2)]
        assert all(grant.waited_s == 0 for grant in grants)
        assert g.holds.starting.get("p", 0) == 2 and g.granted["p"] == 200
        waiting = asyncio.create_task(g.admit(ticket(), 100, "p", views.now, time.perf_counter()))
        await asyncio.sleep(0.05)
        assert not waiting.done()  # two starting: the bound for one DP rank
        grants[0].booked()
        grants[0].started()
        grant = await asyncio.wait_for(waiting, 1.0)
        assert grant.waited_s > 0 and g.granted["p"] == 200 and g.holds.starting.get("p", 0) == 2

    asyncio.run(run())


def test_a_client_leaving_while_queued_leaves_the_queue_at_once() -> None:
    async def run() -> None:
        views = Views(5_000)  # 0.5 s of queue: saturated
        g, metrics = gate(views)
        waiting = asyncio.create_task(g.admit(ticket(), 100, "p", views.now, time.perf_counter()))
        await asyncio.sleep(0.05)
        assert queued(metrics, "default") == 1
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert queued(metrics, "default") == 0 and len(g.policy.pool("p")) == 0
        assert g.holds.starting.get("p", 0) == 0 and g.granted["p"] == 0

    asyncio.run(run())


def test_priority_goes_first_and_a_request_past_its_deadline_is_refused_with_retry_after() -> None:
    async def run() -> None:
        views = Views(0)
        g, metrics = gate(views)
        held = await g.admit(ticket(), 100, "p", views.now, time.perf_counter())  # one of the two starting
        views.now = [view(5_000)]  # saturated
        flex = asyncio.create_task(g.admit(ticket(Tier.FLEX, 0.3), 100, "p", views.now, time.perf_counter()))
        default = asyncio.create_task(g.admit(ticket(), 100, "p", views.now, time.perf_counter()))
        await asyncio.sleep(0.05)
        priority = asyncio.create_task(g.admit(ticket(Tier.PRIORITY, tenant="b"), 100, "p", views.now,
                                               time.perf_counter()))
        with pytest.raises(Overloaded) as refused:
            await flex  # its 0.3 s passed while the pool stayed saturated
        assert int(refused.value.headers["retry-after"]) >= 1
        assert metrics.flow_shed.labels("p", "flex", "deadline")._value.get() == 1
        views.now = [view(0)]  # room for one more start: the priority request, though it came last
        await asyncio.wait_for(priority, 1.0)
        await asyncio.sleep(0.05)
        assert not default.done()
        held.started()  # a first token: the default request's turn
        await asyncio.wait_for(default, 1.0)

    asyncio.run(run())


def test_flex_holds_its_share_of_the_slots_from_its_start_to_its_end() -> None:
    async def run() -> None:
        views = Views(0)
        views.now = [dataclasses.replace(view(0), slots=4)]
        metrics = GatewayMetrics()
        g = FlowGate(SETTINGS.model_copy(update={"flex_max_share": 0.5, "max_engine_waiting": 8}), views,
                     lambda hardware: 10_000.0, metrics)
        flex = [await g.admit(ticket(Tier.FLEX), 100, "p", views.now, time.perf_counter()) for _ in range(2)]
        for grant in flex:
            grant.started()  # a first token: no longer starting, still holding a slot
        assert g.holds.flex["p"] == 2 and g.holds.starting.get("p", 0) == 0
        third = asyncio.create_task(g.admit(ticket(Tier.FLEX), 100, "p", views.now, time.perf_counter()))
        default = await asyncio.wait_for(g.admit(ticket(), 100, "p", views.now, time.perf_counter()), 0.1)
        assert default.waited_s == 0  # the tiers above pass the waiting flex request at once
        await asyncio.sleep(0.05)
        assert not third.done()
        flex[0].ended()
        flex[0].ended()  # idempotent
        assert (await asyncio.wait_for(third, 1.0)).waited_s > 0 and g.holds.flex["p"] == 2
        default.ended()  # not flex: it held no slot
        assert g.holds.flex["p"] == 2

    asyncio.run(run())


def test_flex_yields_the_slots_the_tiers_above_held_lately() -> None:
    async def run() -> None:
        views = Views(0)
        views.now = [dataclasses.replace(view(0), slots=4)]
        g = FlowGate(SETTINGS.model_copy(update={"flex_yield_window_ms": 60_000, "max_engine_waiting": 8}), views,
                     lambda hardware: 10_000.0, GatewayMetrics())
        defaults = [await g.admit(ticket(), 100, "p", views.now, time.perf_counter()) for _ in range(3)]
        for grant in defaults:
            grant.ended()  # their peak, 3, stays reserved for the window
        flex = await g.admit(ticket(Tier.FLEX), 100, "p", views.now, time.perf_counter())
        assert flex.waited_s == 0  # 4 slots - 3 = 1 for flex
        second = asyncio.create_task(g.admit(ticket(Tier.FLEX), 100, "p", views.now, time.perf_counter()))
        await asyncio.sleep(0.05)
        assert not second.done()
        flex.ended()
        assert (await asyncio.wait_for(second, 1.0)).waited_s > 0

    asyncio.run(run())
