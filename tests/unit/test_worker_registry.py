"""WorkerRegistry on a scripted worker client: admission, ejection after failed checks or at
once on a refused request, readmission, a restarted worker's info re-read, and removal taking
the worker's metric series. The worker protocol's adapter (dgw_upstream.py) runs on a scripted
pool standing in for the HTTP library (upstream_http.HttpPool)."""

from __future__ import annotations

from typing import Any

import pytest

from deepinfer_gateway.config import DgwWorkerSpec, HealthSettings
from deepinfer_gateway.core import protocol as wp
from deepinfer_gateway.core.errors import UpstreamError, UpstreamKind
from deepinfer_gateway.gateway.fleet.registry import WorkerRegistry
from deepinfer_gateway.gateway.telemetry.metrics import GatewayMetrics
from deepinfer_gateway.gateway.upstream.dgw import DgwUpstream

URL = "http://w1.test"


def info(epoch: str) -> dict[str, Any]:
    return wp.WorkerInfo(worker_id="w1", engine="sim", role=wp.Role.UNIFIED, hardware=wp.Hardware.SM100,
                         kv_format="fp8", model="m", epoch=epoch).model_dump(mode="json")


def load(queued: int, epoch: str) -> dict[str, Any]:
    return wp.LoadReport(worker_id="w1", role=wp.Role.UNIFIED, hardware=wp.Hardware.SM100, kv_format="fp8",
                         running=2, waiting=0, queued_prefill_tokens=queued, kv_usage=0.5,
                         memory_capacity_blocks=100, dp_ranks=[], epoch=epoch).model_dump(mode="json")


class FakeWorker:
    """Answers get_json like a worker: its load and info reports, or an error while `down`;
    builds the worker protocol's adapter on itself."""

    def __init__(self) -> None:
        self.epoch, self.queued, self.down = "e1", 0, False
        self.info_reads = 0
        self.mux = False  # HttpPool's worker protocol v2 switch: these checks are v1's probes

    async def get_json(self, url: str, path: str) -> dict[str, Any]:
        if self.down:
            raise UpstreamError(UpstreamKind.CONNECT, f"{url}: connection refused")
        if path == wp.INFO_PATH:
            self.info_reads += 1
            return info(self.epoch)
        assert path == wp.LOAD_PATH, path
        return load(self.queued, self.epoch)

    def upstream(self, spec: Any) -> DgwUpstream:
        pool: Any = self  # stands in for HttpPool
        return DgwUpstream(spec, pool)


@pytest.fixture
def rig() -> tuple[WorkerRegistry, FakeWorker, GatewayMetrics]:
    worker, metrics = FakeWorker(), GatewayMetrics()
    registry = WorkerRegistry((DgwWorkerSpec(url=URL),), worker, HealthSettings(failures_to_eject=2), metrics)
    return registry, worker, metrics


def gauge(metrics: GatewayMetrics, name: str, worker_id: str) -> float | None:
    return metrics.registry.get_sample_value(name, {"worker": worker_id})


async def test_a_good_check_admits_with_its_reports_and_gauges(
        rig: tuple[WorkerRegistry, FakeWorker, GatewayMetrics]) -> None:
    registry, worker, metrics = rig
    (state,) = registry.workers.values()
    assert registry.healthy() == [] and state.kv_format == ""
    worker.queued = 700
    await registry.check_all()
    assert registry.healthy() == [state] and registry.healthy(wp.Role.DECODE) == []
    assert (state.kv_format, state.load.queued_prefill_tokens if state.load else None) == ("fp8", 700)
    assert gauge(metrics, "dgw_worker_healthy", state.worker_id) == 1
    assert gauge(metrics, "dgw_worker_queue_tokens", state.worker_id) == 700


async def test_failed_checks_eject_after_the_threshold_and_a_good_one_readmits(
        rig: tuple[WorkerRegistry, FakeWorker, GatewayMetrics]) -> None:
    registry, worker, metrics = rig
    await registry.check_all()
    (state,) = registry.workers.values()
    worker.down = True
    await registry.check_all()
    assert state.healthy  # one failure of two
    await registry.check_all()
    assert not state.healthy and gauge(metrics, "dgw_worker_healthy", state.worker_id) == 0
    worker.down = False
    await registry.check_all()
    assert state.healthy and state.consecutive_failures == 0


async def test_a_refused_request_ejects_at_once(rig: tuple[WorkerRegistry, FakeWorker, GatewayMetrics]) -> None:
    registry, _, _ = rig
    await registry.check_all()
    (state,) = registry.workers.values()
    registry.record_failure(state, "connection refused", eject_now=True)
    assert not state.healthy


async def test_info_is_read_again_only_when_the_worker_restarted(
        rig: tuple[WorkerRegistry, FakeWorker, GatewayMetrics]) -> None:
    registry, worker, _ = rig
    await registry.check_all()
    await registry.check_all()
    assert worker.info_reads == 1
    worker.epoch = "e2"  # a restart: new epoch in the load report
    await registry.check_all()
    (state,) = registry.workers.values()
    assert worker.info_reads == 2 and state.info is not None and state.info.epoch == "e2"


async def test_removal_drops_the_worker_and_its_series(rig: tuple[WorkerRegistry, FakeWorker, GatewayMetrics]) -> None:
    registry, _, metrics = rig
    await registry.check_all()
    (state,) = registry.workers.values()
    retired: list[str] = []
    state.upstream.retire = lambda: retired.append(state.worker_id)  # type: ignore[method-assign]
    assert registry.remove(state.worker_id) and not registry.remove(state.worker_id)
    assert retired == [state.worker_id]  # its v2 connection closes once its legs end
    assert not registry.registered(state)
    assert gauge(metrics, "dgw_worker_healthy", state.worker_id) is None
    registry.record_success(state)  # a late writer (a check or request in flight) writes nothing
    registry.count_error(state, "connect")
    assert gauge(metrics, "dgw_worker_healthy", state.worker_id) is None


async def test_a_workers_counters_and_its_pool_exist_at_zero_from_joining_to_leaving(
        rig: tuple[WorkerRegistry, FakeWorker, GatewayMetrics]) -> None:
    registry, _, metrics = rig
    (configured,) = registry.workers
    added = registry.add(DgwWorkerSpec(url="http://w2.test", pool="big")).worker_id  # as the admin API and discovery do
    for worker_id in (configured, added):
        for kind in UpstreamKind:
            assert metrics.registry.get_sample_value("dgw_upstream_errors_total",
                                                     {"worker": worker_id, "kind": str(kind)}) == 0
    for pool in ("unified", "big"):
        assert metrics.registry.get_sample_value("dgw_admission_rejections_total", {"pool": pool}) == 0
        assert metrics.registry.get_sample_value("dgw_pool_healthy_workers", {"pool": pool}) == 0

    await registry.check_all()
    assert metrics.registry.get_sample_value("dgw_pool_healthy_workers", {"pool": "unified"}) == 1
    assert metrics.registry.get_sample_value("dgw_pool_healthy_workers", {"pool": "big"}) == 1

    assert registry.remove(added)
    assert metrics.registry.get_sample_value("dgw_upstream_errors_total", {"worker": added, "kind": "connect"}) is None
    # The pool stays, at 0: a pool whose workers are all gone serves nothing (DgwNoHealthyWorker fires).
    assert metrics.registry.get_sample_value("dgw_pool_healthy_workers", {"pool": "big"}) == 0
    assert metrics.registry.get_sample_value("dgw_pool_healthy_workers", {"pool": "unified"}) == 1
