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

Pushed reports: a healthy worker whose upstream can push (worker protocol v2, upstream/base.py
`Pushing`) is asked to once a check succeeds; while its connection is up and pushing it
is not probed: its load reports arrive on the connection (each a success) and the
connection's heartbeat is its liveness. When that connection closes the worker is probed
again at the next check (at most `interval_s` later), so a dead one fails its checks and is
ejected as a v1 worker is. The check loop sleeps while every worker pushes.

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

from deepinfer_gateway.config import HealthSettings, WorkerSpec
from deepinfer_gateway.core import protocol as wp
from deepinfer_gateway.core.errors import UpstreamError, UpstreamKind
from deepinfer_gateway.gateway.telemetry.loop_lag import LoopLag
from deepinfer_gateway.gateway.telemetry.metrics import GatewayMetrics
from deepinfer_gateway.gateway.upstream.base import Pushing, Upstream, UpstreamFactory, pushing

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
    admitting: dict[str, int] = field(default_factory=dict)  # of those, sent and not yet scheduled (router/booking.py)
    prefilling: dict[str, tuple[int, float]] = field(default_factory=dict)  # scheduled, no first token yet
    draining: bool = False  # no new requests: it is on its way out
    push_start: asyncio.Task[None] | None = field(default=None, repr=False)  # asking it to push
    pushed_success_at: float = float("-inf")  # loop time a pushed report last counted as a check

    @property
    def pushes_live(self) -> bool:
        """Its load reports arrive pushed: no probe needed."""
        pushes = pushing(self.upstream)
        return pushes is not None and pushes.pushes_live

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
        self._probes_due: asyncio.Event | None = None  # set when a worker may need probing again
        self._checks_in_flight = 0
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
            self._probe_again()
        return state

    def remove(self, worker_id: str) -> bool:
        state = self.workers.pop(worker_id, None)
        if state is not None:
            if state.push_start is not None:
                state.push_start.cancel()
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
        self.loop_lag.busy = self._busy
        self._probes_due = asyncio.Event()
        await self.check_all()
        self._task = asyncio.create_task(self._loop(), name="worker-health")

    async def stop(self) -> None:
        self.loop_lag.stop()
        for worker in self.workers.values():
            if worker.push_start is not None:
                worker.push_start.cancel()
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    async def _loop(self) -> None:
        due = self._probes_due
        assert due is not None
        while True:
            if not any(self._probed(w) for w in self.workers.values()):
                due.clear()
                await due.wait()  # every worker pushes: nothing to do until one stops
            await asyncio.sleep(self._settings.interval_s)
            await self.check_all()

    async def check_all(self) -> None:
        """Probe every worker that does not push its reports (module doc)."""
        await asyncio.gather(*(self._check(w) for w in list(self.workers.values()) if self._probed(w)))

    @staticmethod
    def _probed(worker: WorkerState) -> bool:
        return not (worker.healthy and worker.pushes_live)

    def _probe_again(self) -> None:
        if self._probes_due is not None:
            self._probes_due.set()

    def _busy(self) -> bool:
        """Checks or requests in flight: the loop-lag monitor keeps ticking (their timeouts may be judged)."""
        return self._checks_in_flight > 0 or any(w.inflight for w in self.workers.values())

    async def _check(self, worker: WorkerState) -> None:
        self._checks_in_flight += 1
        try:
            await self._check_once(worker)
        finally:
            self._checks_in_flight -= 1

    async def _check_once(self, worker: WorkerState) -> None:
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
        self._take_load(worker, load, since)
        self.record_success(worker)
        pushes = pushing(worker.upstream)
        if (pushes is not None and worker.healthy and pushes.may_push and not pushes.pushes_live
                and worker.push_start is None):
            worker.push_start = asyncio.create_task(self._start_pushes(worker, pushes),
                                                    name=f"worker-push:{worker.worker_id}")

    async def _start_pushes(self, worker: WorkerState, pushes: Pushing) -> None:
        try:
            await pushes.start_pushes(lambda load, at: self._pushed_load(worker, load, at),
                                      lambda: self._push_ended(worker))
        except UpstreamError as exc:  # the next check probes it as before, and asks again
            log.info("worker %s: no pushed reports (%s)", worker.worker_id, exc)
        finally:
            worker.push_start = None

    def _pushed_load(self, worker: WorkerState, load: wp.LoadReport, at: float) -> None:
        if self.registered(worker):
            self._take_load(worker, load, at)
            # A success at most once per check interval, as a probe: a burst of reports must not
            # clear the request failures that would eject it more often than checks did.
            if at - worker.pushed_success_at >= self._settings.interval_s:
                worker.pushed_success_at = at
                self.record_success(worker)

    def _push_ended(self, worker: WorkerState) -> None:
        if self.registered(worker):
            log.info("worker %s: its pushing connection closed; probing it again", worker.worker_id)
            self._probe_again()

    def _take_load(self, worker: WorkerState, load: wp.LoadReport, since: float) -> None:
        """A load report that counts what was sent to the worker before `since` (loop time)."""
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
        self._metrics.worker_preemptions.labels(worker.worker_id).set(load.preemptions_total)

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
            self._probe_again()  # probed until readmitted, pushing or not
        self._set_healthy(worker)

    def _set_healthy(self, worker: WorkerState) -> None:
        if self.registered(worker):
            self._metrics.worker_healthy.labels(worker.worker_id).set(1 if worker.healthy else 0)
            self._count_pool(worker.pool)

    def _count_pool(self, pool: str) -> None:
        """dgw_pool_healthy_workers{pool}; the series stays at 0 when the pool's last worker goes."""
        healthy = sum(1 for w in self.workers.values() if w.healthy and not w.draining and w.pool == pool)
        self._metrics.pool_healthy.labels(pool).set(healthy)
