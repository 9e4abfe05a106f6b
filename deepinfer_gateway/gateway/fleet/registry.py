"""Worker registry: who the workers are, whether they are healthy, and their last load report.

Each worker is reached through its `Upstream` (upstream/base.py), built on `add` by the worker's
engine kind (upstream/table.py); the registry never asks which engine a worker runs. Active health
checks probe each worker every `interval_s` (its info and load reports, as its adapter reads
them);
`failures_to_eject` consecutive failures eject a worker, `successes_to_readmit` readmit
it. Request failures count as health failures too (passive checks), so a dead worker
is ejected at the first failed request rather than at the next poll.

A worker's counters exist at 0 from the moment it joins (configuration, admin API or
discovery: all go through `add`), so its first error is an increase Prometheus sees. A
removed worker takes its `dgw_*{worker}` series with it; late writers (a health check or a
request still in flight on it) find it gone and write nothing. `dgw_pool_healthy_workers`
follows every change of a worker's health or membership.

`after_report(worker, at, hook)` runs `hook` once a load report whose probe began at or after
`at` (loop time) has been taken in: the request path learns when a report counts a request
it sent (router/booking.py `Booking.on_report`).

A draining worker (`drain`: its address left DNS discovery) takes no new request while
those in flight finish; it stays checked and counted until it is removed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from deepinfer_gateway import protocol as wp
from deepinfer_gateway.config import HealthSettings, WorkerSpec
from deepinfer_gateway.errors import UpstreamError, UpstreamKind
from deepinfer_gateway.gateway.telemetry.loop_lag import LoopLag
from deepinfer_gateway.gateway.telemetry.metrics import GatewayMetrics
from deepinfer_gateway.gateway.upstream.base import Upstream, UpstreamFactory

log = logging.getLogger(__name__)


@dataclass
class WorkerState:
    spec: WorkerSpec
    upstream: Upstream
    healthy: bool = False
    consecutive_failures: int = 0
    consecutive_successes: int = 0
    info: wp.WorkerInfo | None = None
    load: wp.LoadReport | None = None
    load_probed_at: float = 0.0  # loop time when the probe that read `load` began
    # (at, hook): run `hook` once a load report probed at or after `at` is in
    report_hooks: list[tuple[float, Callable[[], None]]] = field(default_factory=list)
    inflight: int = 0  # requests this gateway has open on the worker
    draining: bool = False  # no new requests: it is on its way out

    @property
    def worker_id(self) -> str:
        return self.spec.worker_id

    @property
    def url(self) -> str:
        return self.spec.url

    @property
    def kv_format(self) -> str:
        return self.spec.kv_format or (self.info.kv_format if self.info else "")

    @property
    def pool(self) -> str:
        return self.spec.pool or str(self.spec.role)


class WorkerRegistry:
    def __init__(self, specs: tuple[WorkerSpec, ...], upstreams: UpstreamFactory, settings: HealthSettings,
                 metrics: GatewayMetrics, loop_lag: LoopLag | None = None):
        self._upstreams = upstreams
        self.workers: dict[str, WorkerState] = {}
        # A timeout during this process's own stall is not the worker's failure (loop_lag.py).
        self.loop_lag = loop_lag or LoopLag(histogram=metrics.loop_lag)
        self._settings = settings
        self._metrics = metrics
        self._task: asyncio.Task[None] | None = None
        for spec in specs:
            self.add(spec)

    def healthy(self, role: wp.Role | None = None) -> list[WorkerState]:
        return [w for w in self.workers.values()
                if w.healthy and not w.draining and (role is None or w.spec.role == role)]

    def drain(self, worker_id: str, *, draining: bool = True) -> WorkerState | None:
        """Stop (or, `draining=False`, resume) giving the worker new requests; None if unknown."""
        state = self.workers.get(worker_id)
        if state is not None:
            state.draining = draining
            self._count_pool(state.pool)
        return state

    def add(self, spec: WorkerSpec) -> WorkerState:
        """The worker `spec` names (a known id keeps its state)."""
        state = self.workers.get(spec.worker_id)
        if state is None:
            state = self.workers[spec.worker_id] = WorkerState(spec, self._upstreams.upstream(spec))
            self._metrics.admit_worker(spec.worker_id, state.pool)
            self._count_pool(state.pool)
        return state

    def remove(self, worker_id: str) -> bool:
        state = self.workers.pop(worker_id, None)
        if state is not None:
            state.upstream.retire()
            self._metrics.forget_worker(worker_id)
            self._count_pool(state.pool)
        return state is not None

    def registered(self, worker: WorkerState) -> bool:
        return self.workers.get(worker.worker_id) is worker

    def count_error(self, worker: WorkerState, kind: str) -> None:
        """dgw_upstream_errors_total{worker,kind}, for a worker still in the registry."""
        if self.registered(worker):
            self._metrics.upstream_errors.labels(worker.worker_id, kind).inc()

    async def start(self) -> None:
        self.loop_lag.start()
        await self.check_all()
        self._task = asyncio.create_task(self._loop(), name="worker-health")

    async def stop(self) -> None:
        self.loop_lag.stop()
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self._settings.interval_s)
            await self.check_all()

    async def check_all(self) -> None:
        await asyncio.gather(*(self._check(w) for w in list(self.workers.values())))

    async def _check(self, worker: WorkerState) -> None:
        since = self.loop_lag.now()
        try:
            # The info is read afresh on admission (and, by the adapter, when the worker restarted).
            worker.info, load = await worker.upstream.probe(worker.info if worker.healthy else None)
        except (UpstreamError, ValueError) as exc:
            self.record_failure(worker, f"health check: {exc}",
                                since=since if isinstance(exc, UpstreamError) and exc.kind is UpstreamKind.TIMEOUT
                                else None)
            return
        if not self.registered(worker):  # removed while the check was on the wire
            return
        worker.load = load
        worker.load_probed_at = since
        if worker.report_hooks:
            due = [hook for at, hook in worker.report_hooks if at <= since]
            worker.report_hooks = [(at, hook) for at, hook in worker.report_hooks if at > since]
            for hook in due:
                hook()
        self._metrics.worker_queue_tokens.labels(worker.worker_id).set(load.queued_prefill_tokens)
        self._metrics.worker_running.labels(worker.worker_id).set(load.running)
        self._metrics.worker_kv_usage.labels(worker.worker_id).set(load.kv_usage)
        self.record_success(worker)

    @staticmethod
    def after_report(worker: WorkerState, at: float, hook: Callable[[], None]) -> None:
        """Run `hook` once a load report of `worker` probed at or after `at` (loop time) is in."""
        worker.report_hooks.append((at, hook))

    def record_success(self, worker: WorkerState) -> None:
        worker.consecutive_failures = 0
        worker.consecutive_successes += 1
        if not worker.healthy and worker.consecutive_successes >= self._settings.successes_to_readmit:
            worker.healthy = True
            log.info("worker %s admitted", worker.worker_id)
        self._set_healthy(worker)

    def record_failure(self, worker: WorkerState, why: str, *, eject_now: bool = False,
                       since: float | None = None) -> None:
        """`eject_now` for definitive failures (connection refused) seen on a live request.
        `since` (a timeout: when the call began, on `loop_lag.now()`): not counted when this
        process's own event loop was held up for a good part of the wait (loop_lag.py)."""
        if since is not None and self.loop_lag.blames_self(since):
            self._metrics.stall_timeouts.inc()
            log.info("worker %s: %s, during a %.2f s stall of this process's event loop: not counted against it",
                     worker.worker_id, why, self.loop_lag.own_stall_s(since))
            return
        worker.consecutive_successes = 0
        worker.consecutive_failures += 1
        if worker.healthy and (eject_now or worker.consecutive_failures >= self._settings.failures_to_eject):
            worker.healthy = False
            log.warning("worker %s ejected after %d failures: %s", worker.worker_id,
                        worker.consecutive_failures, why)
        self._set_healthy(worker)

    def _set_healthy(self, worker: WorkerState) -> None:
        if self.registered(worker):
            self._metrics.worker_healthy.labels(worker.worker_id).set(1 if worker.healthy else 0)
            self._count_pool(worker.pool)

    def _count_pool(self, pool: str) -> None:
        """dgw_pool_healthy_workers{pool}; the series stays at 0 when the pool's last worker goes."""
        healthy = sum(1 for w in self.workers.values() if w.healthy and not w.draining and w.pool == pool)
        self._metrics.pool_healthy.labels(pool).set(healthy)
