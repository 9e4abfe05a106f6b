"""The step under way (`WorkerView.step_under_way`): what the gateway's and the simulator's views
say of one DP rank's prefill step, which a request placed beside it waits for. Priced only with
`router.routed_prefix_s` (gateway/serving/route_inputs.py, simulate/cluster.py)."""

from __future__ import annotations

from typing import Any, cast

from deepinfer_gateway.config import DgwWorkerSpec
from deepinfer_gateway.core.protocol import DpRankLoad, FinishReason, LoadReport, Role, WorkerInfo
from deepinfer_gateway.gateway.fleet.registry import WorkerState
from deepinfer_gateway.gateway.serving.route_inputs import worker_view
from deepinfer_gateway.router.inflight import MemoryInflight
from deepinfer_gateway.simulate.cluster import SimWorker
from deepinfer_gateway.workers.sim.core import SimRequest
from deepinfer_gateway.workers.sim.profiles import load_profile


def test_the_largest_booking_is_the_largest_prompt_not_yet_reported() -> None:
    inflight = MemoryInflight()
    assert inflight.largest("w") == 0
    inflight.reserve("w", "a", 3_000)
    inflight.reserve("w", "b", 9_000)
    inflight.reserve("v", "c", 20_000)
    assert inflight.largest("w") == 9_000
    inflight.reserve("w", "b", -5_000)  # reported, waiting: minus its cached part (router/booking.py)
    assert inflight.largest("w") == 3_000
    inflight.release("w", "a")
    assert inflight.largest("w") == 0 and inflight.own("w") == -5_000


def _worker(queues: list[int], batched: int | None = 16_384) -> WorkerState:
    spec = DgwWorkerSpec(url="http://127.0.0.1:9001")
    state = WorkerState(spec=spec, upstream=cast(Any, None))  # worker_view reads no upstream
    state.info = WorkerInfo(worker_id=spec.worker_id, engine="sim", role=Role.UNIFIED, hardware="sm100",
                            kv_format="f", model="m", dp_size=len(queues), max_num_batched_tokens=batched, epoch="e")
    state.load = LoadReport(
        worker_id=spec.worker_id, role=Role.UNIFIED, hardware="sm100", kv_format="f", running=0, waiting=0,
        queued_prefill_tokens=sum(queues), kv_usage=0.0, memory_capacity_blocks=100,
        dp_ranks=[DpRankLoad(dp_rank=r, running=0, waiting=0, queued_prefill_tokens=q) for r, q in enumerate(queues)])
    return state


def test_the_gateways_view_takes_the_longest_rank_or_the_largest_booking_when_priced() -> None:
    worker = _worker([5_000, 0, 100, 0])
    view = worker_view(worker, booked=0)
    assert view is not None and (view.step_under_way, view.step_budget, view.dp_ranks) == (0, 16_384, 4)
    view = worker_view(worker, booked=0, largest=0)
    assert view is not None and view.step_under_way == 5_000  # the longest rank in the report
    view = worker_view(worker, booked=7_000, largest=7_000)
    assert view is not None and view.step_under_way == 7_000  # a prompt sent since, larger
    view = worker_view(worker, booked=-5_000, largest=0)  # the report's waiting prompt is mostly cached
    assert view is not None and (view.queued_prefill_tokens, view.step_under_way) == (100, 100)  # at most the queue
    view = worker_view(_worker([0], batched=None), booked=2_000, largest=2_000)
    assert view is not None and (view.step_under_way, view.step_budget) == (2_000, 0)


def test_the_simulators_view_prices_the_step_as_the_gateway_does() -> None:
    def sim_worker(steps_seen: bool) -> SimWorker:
        worker = SimWorker("w", Role.UNIFIED, "unified", load_profile("sm100"), "m", None, 1.0, steps_seen)
        worker.core.add_request(SimRequest("old", [1] * 6_000, [2], FinishReason.LENGTH))
        worker.book("old", prompt=6_000)
        worker.report()  # the report counts it on one rank
        worker.book("new", prompt=9_000, cached=1_000)
        return worker

    assert sim_worker(steps_seen=False).view().step_under_way == 0
    view = sim_worker(steps_seen=True).view()
    assert (view.queued_prefill_tokens, view.step_under_way) == (14_000, 8_000)
    assert view.step_budget == load_profile("sm100").max_num_batched_tokens
