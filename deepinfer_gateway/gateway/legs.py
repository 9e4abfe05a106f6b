"""Upstream legs: open a worker call, retry it elsewhere, continue on a decode worker.

Retry rule: a failure before a leg's first token (connect error, 5xx, timeout, a retryable
engine error) is retried on another worker, up to `max_attempts` per leg; a non-retryable
one is the worker's verdict on the request and answers the client (`WorkerRefused`).
A PD prefill leg ends with a KV hand-off and `decode` continues on a decode worker of the
same KV format and engine: after the prefill's first token (sim, DeepInfer: relay.py follows
the hand-off), or before any token when the prefill hands off without one (vLLM,
gateway/vllm_pd.py: `first` opens the decode leg itself, so the client's response starts
with the decode worker's first token).

Each open leg holds a `Lease`: the worker's in-flight count, the process gauge, the
connection and, unless the worker finished the request, an explicit abort. Its release
is idempotent, so whoever owns the leg releases it in one `finally`.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from deepinfer_gateway import protocol as wp
from deepinfer_gateway import tracing
from deepinfer_gateway.config import GatewaySettings
from deepinfer_gateway.config_models import WorkerEngine
from deepinfer_gateway.errors import (
    HEALTH_FAILURES,
    NoHealthyWorker,
    UpstreamError,
    UpstreamFailed,
    UpstreamKind,
    WorkerRefused,
)
from deepinfer_gateway.gateway.background import run_in_background
from deepinfer_gateway.gateway.metrics import GatewayMetrics
from deepinfer_gateway.gateway.registry import WorkerRegistry, WorkerState
from deepinfer_gateway.gateway.route_inputs import LEG_ROLE, RouteInputs
from deepinfer_gateway.gateway.vllm_upstream import PREDICTED_CACHED
from deepinfer_gateway.gateway.worker_client import EventStream, WorkerClient
from deepinfer_gateway.recipe_bridge.prepare import PreparedRequest
from deepinfer_gateway.router.planner import NoCandidate, Plan

log = logging.getLogger(__name__)


class Lease:
    """One upstream leg's hold on a worker, taken when the call starts."""

    __slots__ = ("worker", "request_id", "_metrics", "_client", "stream", "ready_at", "released")

    def __init__(self, worker: WorkerState, request_id: str, metrics: GatewayMetrics, client: WorkerClient):
        self.worker = worker
        self.request_id = request_id
        self._metrics = metrics
        self._client = client
        self.stream: EventStream | None = None
        self.ready_at = 0.0  # perf_counter when the leg's `ready` event arrived
        self.released = False
        worker.inflight += 1
        metrics.inflight.inc()

    def release(self, *, abort: bool) -> None:
        """Give the worker back; only the first call acts. `abort`: the worker has not finished
        the request (the dropped connection aborts too; the explicit abort covers proxies
        that keep it open)."""
        if self.released:
            return
        self.released = True
        self.worker.inflight -= 1
        self._metrics.inflight.dec()
        if self.stream is not None:
            self.stream.close()
            if abort:
                run_in_background(self._client.abort(self.worker.url, self.request_id))

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


class Legs:
    def __init__(self, registry: WorkerRegistry, client: WorkerClient, routing: RouteInputs,
                 metrics: GatewayMetrics, settings: GatewaySettings):
        self.registry = registry
        self.client = client
        self.routing = routing
        self.metrics = metrics
        self.settings = settings

    async def first(self, prepared: PreparedRequest, body: dict[str, Any], request_id: str,
                    session_key: str | None) -> tuple[Lease, Plan, dict[str, Any], dict[str, Any]]:
        """The first leg, up to its first token: (its lease, the plan, its `ready`, its first event)."""
        views, hashes, overlap = await self.routing.candidates(prepared)
        planner = self.routing.planner
        tried: set[str] = set()
        last_error: UpstreamError | None = None
        for _ in range(self.settings.max_attempts):
            try:
                plan = planner.plan_first(views, prepared.prompt_tokens, hashes, overlap, session_key,
                                          frozenset(tried))
            except NoCandidate:
                break
            if not tried:
                self.routing.admit(plan, views)
            self.routing.record(plan, request_id)
            tried.add(plan.worker.worker_id)
            worker = self._routable(plan.worker.worker_id)
            if worker is None:  # removed or draining since `views` was read (a retry plans from it)
                continue
            leg_body = {**body, "role": LEG_ROLE[plan.mode]}
            if worker.spec.engine is not WorkerEngine.DGW:  # in-process adapters only: not a wire field
                leg_body[PREDICTED_CACHED] = plan.decision.predicted_memory_tokens  # `ready`'s provisional count
            since = self.registry.loop_lag.now()
            try:
                with tracing.span("worker.generate", kind="client", worker=worker.worker_id, attempt=len(tried),
                                  role=leg_body["role"]):
                    lease, ready, first = await self._open(worker, leg_body, request_id,
                                                           reserve=prepared.prompt_tokens)
            except UpstreamError as exc:
                last_error = exc
                self._failed(worker, exc, request_id, since)
                continue
            if plan.mode == "pd" and first["event"] == "finish" and "kv_handoff" in first:
                lease, first = await self._decode_first(lease, body, first["kv_handoff"], request_id)
            return lease, plan, ready, first
        if last_error is None:
            raise NoHealthyWorker("No healthy worker is available to serve this request; retry shortly.")
        raise UpstreamFailed(f"All {len(tried)} attempted workers failed: {last_error}")

    async def _decode_first(self, prefill: Lease, body: dict[str, Any], handoff: dict[str, Any],
                            request_id: str) -> tuple[Lease, dict[str, Any]]:
        """A prefill leg that handed off before any token (vLLM's PD, gateway/vllm_pd.py: the
        decode worker samples the first token): the decode leg opens now, so the first token,
        TTFT and a failure to hand off all come before the client's response starts."""
        prefill.release(abort=False)  # the prefill finished: its worker keeps the KV for the decode
        try:
            lease, first = await self.decode({**body, "role": "decode", "kv_handoff": handoff},
                                             handoff["kv_format"], request_id)
        except UpstreamError as exc:
            raise UpstreamFailed(f"The prefill on {prefill.worker.worker_id} finished but {exc}") from None
        lease.ready_at = prefill.ready_at  # queue time: until the prefill worker started
        return lease, first

    async def decode(self, body: dict[str, Any], kv_format: str, request_id: str) -> tuple[Lease, dict[str, Any]]:
        """A decode leg continuing a KV hand-off: (its lease, its first event). Only workers of the
        prefill worker's engine are candidates: a KV format names a layout, not the hand-off's
        wire (a vLLM connector's `kv_transfer_params` mean nothing to a DeepInfer worker)."""
        views = await self.routing.views()
        tried: set[str] = set()
        foreign = self._other_engines(body["kv_handoff"]["source_worker"])
        last_error: UpstreamError | None = None
        for _ in range(self.settings.max_attempts):
            try:
                view, decision = self.routing.planner.plan_decode(views, kv_format, len(body["token_ids"]),
                                                                  frozenset(tried | foreign))
            except NoCandidate:
                break
            self.metrics.routing_decisions.labels(view.pool, view.hardware, str(decision.reason)).inc()
            tried.add(view.worker_id)
            worker = self._routable(view.worker_id)
            if worker is None:
                continue
            since = self.registry.loop_lag.now()
            try:
                with tracing.span("worker.generate", kind="client", worker=worker.worker_id, attempt=len(tried),
                                  role="decode"):
                    lease, _ready, first = await self._open(worker, body, request_id)
            except UpstreamError as exc:
                last_error = exc
                self._failed(worker, exc, request_id, since)
                continue
            return lease, first
        raise UpstreamError(UpstreamKind.WORKER_ERROR,
                            f"no decode worker took the hand-off: {last_error or 'none compatible'}", retryable=False)

    async def _open(self, worker: WorkerState, body: dict[str, Any], request_id: str,
                    reserve: int = 0) -> tuple[Lease, dict[str, Any], dict[str, Any]]:
        """Send `body` to `worker`; return once its `ready` and first token (or finish) arrived.
        On any failure, cancellation included, the lease is released before this returns."""
        lease = Lease(worker, request_id, self.metrics, self.client)
        try:
            if reserve:  # inside the try: a Redis round trip is a point where a cancel can land
                await self.routing.inflight.reserve(worker.worker_id, request_id, reserve)
            lease.stream = await self.client.generate(worker.url, body, request_id)
            ready = await lease.next_event()
            lease.ready_at = time.perf_counter()
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
            if reserve:
                await self.routing.inflight.release(worker.worker_id, request_id)

    def _routable(self, worker_id: str) -> WorkerState | None:
        """The worker, if it may still take a new request (not removed, not draining)."""
        worker = self.registry.workers.get(worker_id)
        return None if worker is None or worker.draining else worker

    def _other_engines(self, source_worker: str) -> set[str]:
        """Workers whose engine differs from `source_worker`'s (none known if it is gone)."""
        source = self.registry.workers.get(source_worker)
        if source is None:
            return set()
        engine = source.spec.engine
        return {w.worker_id for w in self.registry.workers.values() if w.spec.engine is not engine}

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
