"""Upstream legs: open a worker call, retry it elsewhere, continue on a decode worker.

Retry rule (`_open_any`, the one skeleton of every leg): a failure before a leg's first
token (connect error, 5xx, timeout, a retryable engine error) is retried on another worker,
up to `max_attempts` per leg; a non-retryable one is the worker's verdict on the request and
answers the client (`WorkerRefused`).
A PD prefill leg ends with a KV hand-off and `hand_off` continues on a decode worker of the
same KV format and hand-off family (upstream/base.py): after the prefill's first token (sim,
DeepInfer: relay.py follows the hand-off), or before any token when the prefill hands off
without one (vLLM, gateway/upstream/vllm_pd.py: `first` follows it, so the client's response starts
with the decode worker's first token).

Each open leg holds a `Lease`: its `Booking` (router/booking.py: the worker's in-flight
count and the first leg's share of its queue), the process gauge, the connection and,
unless the worker finished the request, an explicit abort. Its release
is idempotent, so whoever owns the leg releases it in one `finally`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

from deepinfer_gateway.config import GatewaySettings
from deepinfer_gateway.core import protocol as wp
from deepinfer_gateway.core import tracing
from deepinfer_gateway.core.errors import (
    HEALTH_FAILURES,
    NoHealthyWorker,
    UpstreamError,
    UpstreamFailed,
    UpstreamKind,
    WorkerRefused,
)
from deepinfer_gateway.core.session_identity import SessionIdentity
from deepinfer_gateway.gateway.fleet.registry import WorkerRegistry, WorkerState
from deepinfer_gateway.gateway.serving.background import run_in_background
from deepinfer_gateway.gateway.serving.flow_gate import FlowGate, FlowTicket, Grant
from deepinfer_gateway.gateway.serving.route_inputs import RouteInputs
from deepinfer_gateway.gateway.serving.session_gate import SessionGate
from deepinfer_gateway.gateway.telemetry.metrics import GatewayMetrics
from deepinfer_gateway.gateway.upstream.base import EventStream, LegRequest
from deepinfer_gateway.recipe_bridge.prepare import PreparedRequest
from deepinfer_gateway.router.booking import Booking
from deepinfer_gateway.router.planner import Mode, NoCandidate, Plan, WorkerView

log = logging.getLogger(__name__)


class Lease:
    """One upstream leg's hold on a worker, taken when the call starts: its `Booking` (the
    worker's in-flight count; on a first leg, its share of the worker's queue until the
    first token) and the process gauge."""

    __slots__ = ("booking", "_metrics", "_on_release", "stream", "ready_at", "released", "grant")

    def __init__(self, booking: Booking[WorkerState], metrics: GatewayMetrics,
                 on_release: Callable[[], None] | None = None):
        self.booking = booking
        self._metrics = metrics
        self._on_release = on_release  # flow control looks again: the worker has room
        self.stream: EventStream | None = None
        self.ready_at = 0.0  # perf_counter when the leg's `ready` event arrived
        self.released = False
        self.grant: Grant | None = None  # flow control's, on a first leg: its slot is held until the leg ends
        metrics.inflight.inc()

    @property
    def worker(self) -> WorkerState:
        return self.booking.worker

    @property
    def request_id(self) -> str:
        return self.booking.request_id

    def release(self, *, abort: bool) -> None:
        """Give the worker back; only the first call acts. `abort`: the worker has not finished
        the request (the dropped connection aborts too; the explicit abort covers proxies
        that keep it open)."""
        if self.released:
            return
        self.released = True
        self.booking.end()
        self._metrics.inflight.dec()
        if self.grant is not None:
            self.grant.ended()
        if self._on_release is not None:
            self._on_release()
        if self.stream is not None:
            self.stream.close()
            if abort:
                run_in_background(self.worker.upstream.abort(self.request_id))

    async def next_event(self) -> dict[str, Any] | None:
        assert self.stream is not None
        return await self.stream.next_event()


def raise_if_error(finish: dict[str, Any]) -> None:
    """Raise the error a worker's `finish` event (or a finish instead of `ready`) reports."""
    error = finish.get("error")
    if finish.get("reason") == wp.FinishReason.ERROR or error:
        error = error or {}
        kind = error.get("kind", "engine")
        message = error.get("message", "engine error")
        raise UpstreamError(UpstreamKind.WORKER_ERROR, f"{kind}: {message}", detail=message,
                            retryable=bool(error.get("retryable", False)),
                            status=400 if kind in wp.CLIENT_ERRORS else 503)
    if finish.get("reason") == wp.FinishReason.ABORT:
        raise UpstreamError(UpstreamKind.WORKER_ERROR, "the worker aborted the request", retryable=True, status=503)


class _Exhausted(Exception):
    """Every attempt of a leg failed, or no candidate was left."""

    def __init__(self, attempts: int, last: UpstreamError | None):
        super().__init__(str(last))
        self.attempts = attempts
        self.last = last


# Chooses the next worker (its id) for a leg, none of `tried` (NoCandidate when none is left),
# and the leg as that worker gets it.
Chooser = Callable[[frozenset[str]], tuple[str, LegRequest]]


class Legs:
    def __init__(self, registry: WorkerRegistry, routing: RouteInputs, metrics: GatewayMetrics,
                 settings: GatewaySettings, gate: FlowGate | None = None, sessions: SessionGate | None = None):
        self.registry = registry
        self.routing = routing
        self.metrics = metrics
        self.settings = settings
        self.gate = gate  # flow control (flow_gate.py), when enabled
        self.sessions = sessions  # sessions under cache pressure (session_gate.py), when enabled

    async def first(self, prepared: PreparedRequest, leg: LegRequest, session: SessionIdentity,
                    flow: FlowTicket | None = None, arrival: float = 0.0
                    ) -> tuple[Lease, Plan, dict[str, Any], dict[str, Any], list[WorkerView]]:
        """The first leg, up to its first token: (its lease, the plan, its `ready`, its first event,
        the views it was planned on). `flow`: its ticket when flow control is on (it may wait
        here for its pool, or be refused 429, before any worker call). With session capacity on,
        a session's round may first wait for room on its worker; its round ends when the caller's
        exchange closes (`SessionGate.ended`), or here when this raises."""
        try:
            return await self._first(prepared, leg, session, flow, arrival)
        except BaseException:
            if self.sessions is not None:
                self.sessions.ended(leg.request_id)
            raise

    async def _first(self, prepared: PreparedRequest, leg: LegRequest, session: SessionIdentity,
                     flow: FlowTicket | None, arrival: float
                     ) -> tuple[Lease, Plan, dict[str, Any], dict[str, Any], list[WorkerView]]:
        views, hashes, overlap = await self.routing.candidates(prepared, leg.cache_salt)
        self.routing.observe_session(session, hashes)
        planner = self.routing.planner
        plans: list[Plan] = []
        lineage = await self.routing.lineage(session)
        room = None
        if self.sessions is not None and session.session is not None:
            room = await self.sessions.admit(leg.request_id, session.session, prepared.prompt_tokens, views, overlap,
                                             planner.first_pool(views, prepared.prompt_tokens, overlap))
            if room.waited_s:  # the cache and the load moved while it waited
                views, hashes, overlap = await self.routing.candidates(prepared, leg.cache_salt)
        grant: Grant | None = None
        if self.gate is not None and flow is not None:
            pool = planner.first_pool(views, prepared.prompt_tokens, overlap)
            grant = await self.gate.admit(flow, prepared.prompt_tokens, pool, views, arrival)
            if grant.waited_s:
                try:  # the load (and the cache) moved while it waited: plan on what is there now
                    views, hashes, overlap = await self.routing.candidates(prepared, leg.cache_salt)
                except BaseException:
                    grant.ended()
                    raise

        def choose(tried: frozenset[str]) -> tuple[str, LegRequest]:
            now = self.routing.current(views)
            avoid = tried or (room.avoid if room is not None else tried)
            try:
                plan = planner.plan_first(now, prepared.prompt_tokens, hashes, overlap, session.session, avoid,
                                          lineage=lineage)
            except NoCandidate:
                if tried or not avoid:
                    raise
                # the workers its room left in (a waited round's: the one it began on) are gone
                plan = planner.plan_first(now, prepared.prompt_tokens, hashes, overlap, session.session,
                                          lineage=lineage)
            if not plans:
                if grant is not None:
                    grant.booked()  # its booking on the worker counts its tokens from here
                if room is not None:
                    room.placed(plan.worker.worker_id)
                self.routing.admit(plan, now)
            self.routing.record(plan, leg.request_id, hashes)
            plans.append(plan)
            return (plan.worker.worker_id,
                    dataclasses.replace(leg, role=plan.mode.first_role,
                                        predicted_cached=plan.decision.predicted_memory_tokens))

        try:
            lease, ready, first = await self._open_any(choose, leg.request_id, reserve=prepared.prompt_tokens)
        except BaseException as exc:
            if grant is not None:
                grant.ended()
            if not isinstance(exc, _Exhausted):
                raise
            if exc.last is None:
                raise NoHealthyWorker("No healthy worker is available to serve this request; retry shortly.") from None
            # each failure was logged with its worker (`_failed`); the client reads no address
            raise UpstreamFailed(f"All {exc.attempts} attempted workers failed: {exc.last.detail}") from None
        if grant is not None:
            grant.started()  # its first token: the pool may start another
            lease.grant = grant  # ... and its slot is free when the leg ends
        plan = plans[-1]
        await self.routing.remember(session, plan)
        if plan.mode is Mode.PD and first["event"] == "finish" and "kv_handoff" in first:
            # Handed off before any token (vLLM's PD, gateway/upstream/vllm_pd.py: the decode worker samples
            # the first token): the decode leg opens now, so the first token, TTFT and a failure
            # to hand off all come before the client's response starts.
            prefill = lease
            try:
                lease, first = await self.hand_off(prefill, leg, first["kv_handoff"])
            except UpstreamError as exc:
                log.warning("prefill on %s finished but %s", prefill.worker.worker_id, exc)
                raise UpstreamFailed(f"The prefill finished but {exc.detail}") from None
            lease.ready_at = prefill.ready_at  # queue time: until the prefill worker started
        return lease, plan, ready, first, views

    async def hand_off(self, prefill: Lease, leg: LegRequest, handoff: dict[str, Any],
                       output_ids: list[int] | None = None) -> tuple[Lease, dict[str, Any]]:
        """The one place a PD hand-off continues: the prefill leg is done (its worker keeps the KV
        for the decode), and the decode leg opens with `handoff` and the prompt plus the
        prefill's tokens (`output_ids`: none when it handed off before any)."""
        prefill.release(abort=False)
        token_ids = [*leg.token_ids, *output_ids] if output_ids else None
        return await self.decode(leg.decode(handoff, token_ids), handoff["kv_format"])

    async def decode(self, leg: LegRequest, kv_format: str) -> tuple[Lease, dict[str, Any]]:
        """A decode leg continuing a KV hand-off: (its lease, its first event). Only workers of the
        prefill worker's hand-off family are candidates: a KV format names a layout, not the
        hand-off's wire (a vLLM connector's `kv_transfer_params` mean nothing to a DeepInfer worker)."""
        assert leg.kv_handoff is not None
        views = await self.routing.views()
        foreign = self._other_families(leg.kv_handoff["source_worker"])

        def choose(tried: frozenset[str]) -> tuple[str, LegRequest]:
            view, decision = self.routing.planner.plan_decode(views, kv_format, len(leg.token_ids), tried | foreign)
            self.metrics.routing_decisions.labels(view.pool, view.hardware, str(decision.reason)).inc()
            return view.worker_id, leg

        try:
            lease, _ready, first = await self._open_any(choose, leg.request_id)
        except _Exhausted as exc:
            raise UpstreamError(UpstreamKind.WORKER_ERROR,
                                f"no decode worker took the hand-off: {exc.last or 'none compatible'}",
                                retryable=False, detail="no decode worker took the hand-off") from None
        return lease, first

    async def _open_any(self, choose: Chooser, request_id: str,
                        reserve: int = 0) -> tuple[Lease, dict[str, Any], dict[str, Any]]:
        """Open the leg on the workers `choose` names, one after another, until one reaches its first
        token; `_Exhausted` after `max_attempts` failures or when no candidate is left."""
        tried: set[str] = set()
        last_error: UpstreamError | None = None
        for _ in range(self.settings.max_attempts):
            try:
                worker_id, leg = choose(frozenset(tried))
            except NoCandidate:
                break
            tried.add(worker_id)
            worker = self._routable(worker_id)
            if worker is None:  # removed or draining since the views were read (a retry plans from them)
                continue
            since = self.registry.loop_lag.now()
            try:
                with tracing.span("worker.generate", kind="client", worker=worker.worker_id, attempt=len(tried),
                                  role=str(leg.role), **{"dgw.request_id": leg.request_id}):  # the worker's id
                    return await self._open(worker, leg, reserve)
            except UpstreamError as exc:
                last_error = exc
                self._failed(worker, exc, request_id, since)
        raise _Exhausted(len(tried), last_error)

    async def _open(self, worker: WorkerState, leg: LegRequest,
                    reserve: int = 0) -> tuple[Lease, dict[str, Any], dict[str, Any]]:
        """Open `leg` on `worker` (`reserve`: the prompt tokens a first leg books in the worker's
        queue, router/booking.py); return once its `ready` and first token (or finish) arrived.
        On any failure, cancellation included, the lease is released before this returns."""
        booking = Booking(self.routing.inflight, worker, leg.request_id, reserve, leg.predicted_cached)
        lease = Lease(booking, self.metrics, self.gate.wake if self.gate is not None else None)
        try:
            lease.stream = await worker.upstream.generate(leg)
            if booking.queued and worker.upstream.reports_queue:
                # The worker holds the request now: a report probed from here on counts it.
                self.registry.after_report(worker, self.registry.loop_lag.now(), booking.on_report)
            ready = await lease.next_event()
            lease.ready_at = time.perf_counter()
            booking.on_ready(time.monotonic())  # the planner's clock
            if ready is not None and ready["event"] == "finish":
                raise_if_error(ready)  # refused before scheduling: finish without ready
            if ready is None or ready["event"] != "ready":
                raise UpstreamError(UpstreamKind.PROTOCOL,
                                    f"worker {worker.worker_id} did not start with a ready event")
            first = await lease.next_event()
            if first is None:
                raise UpstreamError(UpstreamKind.PROTOCOL,
                                    f"worker {worker.worker_id} closed the stream before a token")
            if first["event"] == "finish" and "kv_handoff" not in first:
                raise_if_error(first)
            self.registry.record_success(worker)
            return lease, ready, first
        except BaseException:
            lease.release(abort=False)  # the closed connection is the abort
            raise
        finally:
            booking.unqueue()

    def _routable(self, worker_id: str) -> WorkerState | None:
        """The worker, if it may still take a new request (not removed, not draining)."""
        worker = self.registry.workers.get(worker_id)
        return None if worker is None or worker.draining else worker

    def _other_families(self, source_worker: str) -> frozenset[str]:
        """Workers that cannot continue `source_worker`'s hand-offs (none known if it is gone)."""
        source = self.registry.workers.get(source_worker)
        if source is None:
            return frozenset()
        family = source.upstream.handoff_family
        return frozenset(w.worker_id for w in self.registry.workers.values() if w.upstream.handoff_family != family)

    def _failed(self, worker: WorkerState, exc: UpstreamError, request_id: str, since: float | None = None) -> None:
        """Count a failed attempt (begun at `since`, on the registry's loop clock); raise the
        worker's verdict if another worker would not do better."""
        self.registry.count_error(worker, exc.kind)
        if exc.kind in HEALTH_FAILURES:
            self.registry.record_failure(worker, str(exc), eject_now=exc.kind is UpstreamKind.CONNECT,
                                         since=since if exc.kind is UpstreamKind.TIMEOUT else None)
        if not exc.retryable:
            raise WorkerRefused.of(exc) from None
        self.metrics.retries.labels(exc.kind).inc()
        log.warning("request %s: attempt on %s failed (%s), retrying", request_id, worker.worker_id, exc)
