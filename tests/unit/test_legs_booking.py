"""A request's booking on the request path (gateway/serving/legs.py, router/booking.py `Booking`):
its uncached prompt until a load report counts it, then its reported whole prompt less its
cached part while it waits, nothing once the worker scheduled it. On scripted worker calls
(tests/unit/test_request_server.py's rig) with a worker that reports its queue; the registry,
planner, index and in-memory bookings are the real ones."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from deepinfer_gateway.core import protocol as wp
from deepinfer_gateway.core.errors import Overloaded
from deepinfer_gateway.gateway.upstream.base import LegRequest, Probe
from deepinfer_gateway.kvcache.types import Overlap
from deepinfer_gateway.router.worker_view import WorkerView
from tests.unit.test_request_server import (  # the scripted upstream seam
    URLS,
    RequestPreparer,
    Rig,
    ScriptedClient,
    ScriptedStream,
    ScriptedUpstream,
    ok_script,
    prepared_chat,
    preparer,  # noqa: F401 (the module-scoped fixture)
)


class GatedStream(ScriptedStream):
    """Its `ready` waits for `gate`: the request sits in the worker's queue meanwhile."""

    def __init__(self, script: list[Any], gate: asyncio.Event):
        super().__init__(script)
        self.gate = gate

    async def next_event(self) -> dict[str, Any] | None:
        await self.gate.wait()
        return await super().next_event()


class QueueReporting(ScriptedUpstream):
    def __init__(self, client: ScriptedClient, spec: Any):
        super().__init__(client, spec)
        self.reports_queue = True
        self.queued = 0

    async def probe(self, known: wp.WorkerInfo | None) -> Probe:
        assert known is not None
        load = wp.LoadReport(worker_id=known.worker_id, role=wp.Role.UNIFIED, hardware=wp.Hardware.SM100,
                             kv_format="fp8", running=0, waiting=1, queued_prefill_tokens=self.queued, kv_usage=0.0,
                             memory_capacity_blocks=1000, dp_ranks=[])
        return Probe(known, load)


class GatedClient(ScriptedClient):
    def __init__(self, gate: asyncio.Event):
        super().__init__({URLS[0]: [ok_script()]})
        self.gate = gate
        self.upstreams: list[QueueReporting] = []

    def upstream(self, spec: Any) -> Any:
        self.upstreams.append(QueueReporting(self, spec))
        return self.upstreams[-1]

    async def generate(self, url: str, leg: LegRequest) -> ScriptedStream:
        stream = GatedStream(self.scripts[url].pop(0), self.gate)
        self.streams.append(stream)
        return stream


class GatedRig(Rig):
    """The request-server rig on a `GatedClient` (one worker that reports its queue)."""

    def __init__(self, gate: asyncio.Event):
        super().__init__({URLS[0]: []})
        self.client = client = GatedClient(gate)
        for w in self.registry.workers.values():
            w.upstream = client.upstream(w.spec)


async def test_booking_follows_the_load_reports(preparer: RequestPreparer) -> None:  # noqa: F811
    gate = asyncio.Event()
    rig = GatedRig(gate)
    client = rig.client
    assert isinstance(client, GatedClient)
    registry = rig.registry
    registry.loop_lag.start()
    inflight = rig.server.routing.inflight
    (worker,) = registry.workers.values()
    upstream = client.upstreams[0]
    try:
        await registry.check_all()  # a load report before the request: empty queue
        prepared = prepared_chat(preparer)
        prompt = prepared.prompt_tokens
        serving = asyncio.create_task(rig.serve(prepared))
        while not client.streams:
            await asyncio.sleep(0.001)
        assert await inflight.totals([worker.worker_id]) == {worker.worker_id: prompt}  # not reported: booked
        (view,) = await rig.server.routing.views()
        assert view.queued_prefill_tokens == prompt and view.booked_tokens == prompt
        upstream.queued = prompt  # the worker reports the waiting prompt whole
        await asyncio.sleep(0.002)
        await registry.check_all()
        (view,) = await rig.server.routing.views()
        assert view.queued_prefill_tokens == prompt, "counted twice: in the report and in the booking"
        assert view.booked_tokens == 0  # minus its cached part (none: a cold index)
        gate.set()  # scheduled: its ready and first token come
        await serving
        assert await inflight.totals([worker.worker_id]) == {worker.worker_id: 0}
        await registry.check_all()  # a late hook finds it released: nothing booked again
        assert await inflight.totals([worker.worker_id]) == {worker.worker_id: 0}
    finally:
        registry.loop_lag.stop()



async def test_a_burst_is_planned_and_admitted_on_its_own_bookings(preparer: RequestPreparer) -> None:  # noqa: F811
    """Two requests read their views before either picks (as a burst does: awaits lie between):
    the second is planned and admitted on the first's booking, not on the views it read."""
    rig = Rig({URLS[0]: []})
    routing = rig.server.routing
    (worker,) = rig.registry.workers.values()
    prompt = prepared_chat(preparer).prompt_tokens
    room = rig.settings.router.model_copy(update={"admission_queued_tokens": prompt - 1})  # one prompt, not two
    routing.settings = rig.settings.model_copy(update={"router": room})
    first_read, second_read = await routing.views(), await routing.views()

    def admit(read: list[WorkerView]) -> None:
        now = routing.current(read)
        routing.admit(routing.planner.plan_first(now, prompt, {}, Overlap(), None, frozenset()), now)

    admit(first_read)
    routing.inflight.reserve(worker.worker_id, "req-1", prompt)  # the first's booking, as `Booking` takes it
    worker.inflight += 1
    (now,) = routing.current(second_read)
    assert (second_read[0].queued_prefill_tokens, now.queued_prefill_tokens) == (0, prompt)
    assert (second_read[0].running, now.running) == (0, 1)
    with pytest.raises(Overloaded):
        admit(second_read)  # on the views it read, it would pass
    routing.inflight.release(worker.worker_id, "req-1")
    admit(second_read)  # released since: the queue is empty again
