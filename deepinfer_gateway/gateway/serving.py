"""The request path after parsing: route -> worker(s) -> relay tokens -> protocol response.

Routing: the prompt's block hashes (one chain per KV format) are looked up in the prefix
index in one call; `RoutePlanner` picks the first leg (unified, prefill, or a decode
worker on PD bypass). In PD mode the prefill leg ends with a KV hand-off and a decode
leg on a compatible worker continues; the client sees one stream.

Retry rule: a failure before the first token reaches the client (connect error, 5xx,
timeout, a retryable engine error) is retried on another worker, up to `max_attempts`
per leg; the decode leg may also be retried on another decode worker until its first
token. After a token from a leg reached the client, a failure ends the stream with a
protocol error event, never silently. The client's response starts only once the first
token is in hand, so every pre-first-token failure can become a retry or a proper
HTTP error status.

Bookkeeping (in-flight counts and reservations, upstream connections, metrics) is
released in `finally` blocks whichever way a request ends: finish, error, or the client
going away (Starlette cancels the body iterator; the gateway closes the worker
connection, which the worker treats as an abort, and also sends an explicit abort).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.responses import Response, StreamingResponse

from deepinfer_gateway import protocol as wp
from deepinfer_gateway.config import GatewaySettings
from deepinfer_gateway.errors import (
    HEALTH_FAILURES,
    GatewayError,
    NoHealthyWorker,
    Overloaded,
    UpstreamError,
    UpstreamFailed,
    UpstreamKind,
    WorkerRefused,
)
from deepinfer_gateway.gateway.error_json import stream_error_frame
from deepinfer_gateway import tracing
from deepinfer_gateway.gateway.metrics import GatewayMetrics, RequestSeries
from deepinfer_gateway.gateway.registry import WorkerRegistry, WorkerState
from deepinfer_gateway.gateway.worker_client import WorkerClient, WorkerStream
from deepinfer_gateway.kvcache.hashing import PrefixHasher
from deepinfer_gateway.kvcache.types import Overlap, PrefixIndex
from deepinfer_gateway.recipe_bridge.prepare import PreparedRequest
from deepinfer_gateway.recipe_bridge.stream import ID_PREFIX, ResponseStream
from deepinfer_gateway.recipe_bridge.tokenizer import TokenizerBundle
from deepinfer_gateway.router.inflight import MemoryInflight, RedisInflight
from deepinfer_gateway.router.planner import NoCandidate, Plan, RoutePlanner, WorkerView, prompt_hashes

log = logging.getLogger(__name__)

SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}
WORKER_HEADER = "x-dgw-worker"
_LEG_ROLE = {"unified": "unified", "pd": "prefill", "bypass": "unified"}


@dataclass
class _Leg:
    """One open worker call."""

    worker: WorkerState
    stream: WorkerStream
    ready_at: float  # perf_counter when its `ready` event arrived
    closed: bool = False


@dataclass
class _Upstream:
    """A request past its first token: the current leg and the response being built."""

    leg: _Leg
    plan: Plan
    body: dict[str, Any]
    response: ResponseStream
    head: bytes  # protocol bytes produced so far (ready + first tokens), not yet sent
    first_series: RequestSeries  # the first leg's (model, pool, hardware): TTFT, queue time, prompt length
    series: RequestSeries  # the current leg's: ITL, duration, output length
    pending: list[dict[str, Any]] = field(default_factory=list)  # events read ahead of the relay
    output_ids: list[int] = field(default_factory=list)  # tokens so far (the decode leg continues them)
    finished: bool = False
    status: str | None = None  # streaming outcome: 200, 502; None until known (client gone: 499)
    on_done: Callable[[int], None] | None = None


class RequestServer:
    def __init__(self, registry: WorkerRegistry, client: WorkerClient, planner: RoutePlanner, index: PrefixIndex,
                 inflight: MemoryInflight | RedisInflight, bundle: TokenizerBundle, metrics: GatewayMetrics,
                 settings: GatewaySettings):
        self.registry = registry
        self.client = client
        self.planner = planner
        self.index = index
        self.inflight = inflight
        self.bundle = bundle
        self.metrics = metrics
        self.settings = settings
        self.hasher = PrefixHasher()

    async def serve(self, prepared: PreparedRequest, request_id: str, arrival: float, *,
                    workload_class: str = "chat", headers: dict[str, str] | None = None,
                    on_done: Callable[[int], None] | None = None, session_key: str | None = None) -> Response:
        """`on_done(completion_tokens)` runs once when the request ends, however it ends."""
        response_id = ID_PREFIX[prepared.protocol] + uuid.uuid4().hex
        body = {
            "request_id": request_id,
            "token_ids": prepared.token_ids,
            "sampling": prepared.sampling.model_dump(by_alias=True, exclude_defaults=True),
            "workload_class": workload_class,
            **prepared.worker_fields(),  # images
        }
        upstream = await self._start(prepared, body, request_id, response_id, session_key or prepared.user, arrival)
        upstream.on_done = on_done
        if not prepared.stream:
            upstream.first_series.ttft.observe(time.perf_counter() - arrival)
        headers = {**(headers or {}), wp.REQUEST_ID_HEADER: request_id, WORKER_HEADER: upstream.leg.worker.worker_id}
        if prepared.stream:
            return _RelayResponse(self._relay(prepared, upstream, request_id, arrival),
                                  on_close=lambda: self._close_stream(prepared, upstream, request_id, arrival),
                                  media_type="text/event-stream", headers={**SSE_HEADERS, **headers})
        try:
            await self._drain(prepared, upstream, request_id)
        finally:
            self._finish(upstream, request_id)
            self._observe_done(upstream, arrival)
        self.metrics.requests.labels(str(prepared.protocol), prepared.model, "200").inc()
        return Response(upstream.response.body(), media_type="application/json", headers=headers)

    # --- routing ------------------------------------------------------------------------

    async def _views(self) -> list[WorkerView]:
        workers = self.registry.healthy()
        reserved = await self.inflight.totals([w.worker_id for w in workers])
        views = []
        for w in workers:
            if w.info is None:
                continue
            load = w.load
            views.append(WorkerView(
                worker_id=w.worker_id, role=w.spec.role, pool=w.pool, hardware=str(w.spec.hardware),
                kv_format=w.kv_format, model=w.info.model,
                queued_prefill_tokens=(load.queued_prefill_tokens if load else 0) + reserved.get(w.worker_id, 0),
                running=(load.running if load else 0) + w.inflight,
                dp_ranks=len(load.dp_ranks) if load and load.dp_ranks else w.info.dp_size,
                prefills=w.info.prefills,
            ))
        return views

    async def _overlap(self, views: list[WorkerView], hashes: dict[str, list[int]]) -> Overlap:
        started = time.perf_counter()
        overlap = await self.index.lookup(hashes, {v.worker_id: v.kv_format for v in views})
        self.metrics.prefix_lookup.observe(time.perf_counter() - started)
        return overlap

    def _admit(self, plan: Plan, views: list[WorkerView]) -> None:
        """Admission control: refuse (429) when the chosen pool's queued prefill exceeds the budget."""
        budget = self.settings.router.admission_queued_tokens
        if not budget:
            return
        pool = [v for v in views if v.pool == plan.worker.pool]
        queued = sum(v.queued_prefill_tokens for v in pool)
        if queued <= budget:
            return
        speed = sum(self.planner.hardware_cost(v.hardware).prefill_tokens_per_s for v in pool)
        retry_after = max(1, math.ceil((queued - budget) / speed))
        self.metrics.admission_rejections.labels(plan.worker.pool).inc()
        raise Overloaded(f"Pool {plan.worker.pool} is overloaded ({queued} queued prompt tokens); retry later.",
                         headers={"retry-after": str(retry_after)})

    def _record(self, plan: Plan, request_id: str) -> None:
        w = plan.worker
        self.metrics.routing_decisions.labels(w.pool, w.hardware, str(plan.decision.reason)).inc()
        tracing.current_span().set_attributes({"route.mode": plan.mode, "route.worker": w.worker_id,
                                               "route.reason": str(plan.decision.reason)})
        if log.isEnabledFor(logging.DEBUG):
            log.debug("route %s mode=%s worker=%s reason=%s predicted=%d/%d costs=%s", request_id, plan.mode,
                      w.worker_id, plan.decision.reason, plan.decision.predicted_memory_tokens,
                      plan.decision.predicted_store_tokens, plan.decision.costs)

    # --- the first token --------------------------------------------------------------------

    async def _start(self, prepared: PreparedRequest, body: dict[str, Any], request_id: str, response_id: str,
                     session_key: str | None, arrival: float) -> _Upstream:
        views = await self._views()
        if not views:
            raise NoHealthyWorker("No healthy worker is available to serve this request; retry shortly.")
        with tracing.span("router.lookup", candidates=len(views)):
            hashes = prompt_hashes(prepared.token_ids, views, self.hasher, prepared.packed_tokens)
            overlap = await self._overlap(views, hashes)
        tried: set[str] = set()
        last_error: UpstreamError | None = None
        for _ in range(self.settings.max_attempts):
            try:
                plan = self.planner.plan_first(views, prepared.prompt_tokens, hashes, overlap, session_key,
                                               frozenset(tried))
            except NoCandidate:
                break
            if not tried:
                self._admit(plan, views)
            self._record(plan, request_id)
            worker = self.registry.workers[plan.worker.worker_id]
            tried.add(worker.worker_id)
            leg_body = {**body, "role": _LEG_ROLE[plan.mode]}
            try:
                with tracing.span("worker.generate", kind="client", worker=worker.worker_id, attempt=len(tried),
                                  role=leg_body["role"]):
                    leg, ready, first = await self._open(worker, leg_body, request_id,
                                                         reserve=prepared.prompt_tokens)
            except UpstreamError as exc:
                last_error = exc
                self._failed(worker, exc, request_id)
                continue
            response = ResponseStream(prepared, self.bundle, response_id)
            series = self.metrics.request_series(prepared.model, worker.pool, worker.spec.hardware)
            upstream = _Upstream(leg, plan, body, response, b"", series, series)
            cached = ready["cached_tokens"]
            upstream.head = response.ready(ready["prompt_tokens"], cached["memory"] + cached["store"])
            series.queue.observe(leg.ready_at - arrival)
            series.prompt_len.observe(ready["prompt_tokens"])
            self._count_prompt(plan, ready)
            upstream.pending.append(first)
            return upstream
        if last_error is None:
            raise NoHealthyWorker("No healthy worker is available to serve this request; retry shortly.")
        raise UpstreamFailed(f"All {len(tried)} attempted workers failed: {last_error}")

    async def _open(self, worker: WorkerState, body: dict[str, Any], request_id: str,
                    reserve: int = 0) -> tuple[_Leg, dict[str, Any], dict[str, Any]]:
        """Send `body` to `worker`; return once its `ready` and first token (or finish) arrived."""
        worker.inflight += 1
        self.metrics.inflight.inc()
        stream: WorkerStream | None = None
        try:
            if reserve:  # inside the try: a Redis round trip is a point where a cancel can land
                await self.inflight.reserve(worker.worker_id, request_id, reserve)
            stream = await self.client.generate(worker.url, body, request_id)
            ready = await stream.next_event()
            ready_at = time.perf_counter()
            if ready is not None and ready["event"] == "finish":
                _raise_if_error(ready)  # refused before scheduling: finish without ready
            if ready is None or ready["event"] != "ready":
                raise UpstreamError(UpstreamKind.PROTOCOL, f"worker {worker.worker_id} did not start with a ready event")
            first = await stream.next_event()
            if first is None:
                raise UpstreamError(UpstreamKind.PROTOCOL, f"worker {worker.worker_id} closed the stream before a token")
            if first["event"] == "finish" and "kv_handoff" not in first:
                _raise_if_error(first)
            self.registry.record_success(worker)
            return _Leg(worker, stream, ready_at), ready, first
        except BaseException:
            worker.inflight -= 1
            self.metrics.inflight.dec()
            if stream is not None:
                stream.close()
            raise
        finally:
            if reserve:
                await self.inflight.release(worker.worker_id, request_id)

    def _failed(self, worker: WorkerState, exc: UpstreamError, request_id: str) -> None:
        self.registry.count_error(worker, exc.kind)
        if exc.kind in HEALTH_FAILURES:
            self.registry.record_failure(worker, str(exc), eject_now=exc.kind is UpstreamKind.CONNECT)
        if not exc.retryable:
            raise WorkerRefused.of(exc) from None
        self.metrics.retries.labels(exc.kind).inc()
        log.warning("request %s: attempt on %s failed (%s), retrying", request_id, worker.worker_id, exc)

    def _count_prompt(self, plan: Plan, ready: dict[str, Any]) -> None:
        prompt = ready["prompt_tokens"]
        reported = ready["cached_tokens"]
        predicted = {"memory": plan.decision.predicted_memory_tokens, "store": plan.decision.predicted_store_tokens}
        self.metrics.prompt_tokens.inc(prompt)
        for tier in ("memory", "store"):
            if reported.get(tier):
                self.metrics.cached_tokens.labels(tier).inc(reported[tier])
            if predicted[tier]:
                self.metrics.predicted_cached_tokens.labels(tier).inc(predicted[tier])
        error = (predicted["memory"] + predicted["store"] - reported["memory"] - reported["store"]) / max(prompt, 1)
        self.metrics.prediction_error.observe(error)

    # --- after the first token ------------------------------------------------------------

    async def _events(self, upstream: _Upstream, request_id: str) -> AsyncIterator[dict[str, Any]]:
        while True:
            event = upstream.pending.pop(0) if upstream.pending else await upstream.leg.stream.next_event()
            if event is None:
                raise UpstreamError(UpstreamKind.PROTOCOL, f"worker {upstream.leg.worker.worker_id} ended the stream early")
            if event["event"] == "tokens":
                upstream.output_ids.extend(event["token_ids"])
                yield event
            elif event["event"] == "finish":
                handoff = event.get("kv_handoff")
                if handoff is None or upstream.plan.mode != "pd":
                    upstream.finished = True
                    yield event
                    return
                await self._hand_off(upstream, handoff, request_id)
            # a decode leg's own `ready` carries no prompt usage of interest: skip it

    async def _hand_off(self, upstream: _Upstream, handoff: dict[str, Any], request_id: str) -> None:
        """Prefill finished with a KV hand-off: continue on a compatible decode worker."""
        self._close_leg(upstream.leg, request_id, abort=False)
        body = {**upstream.body, "role": "decode", "kv_handoff": handoff,
                "token_ids": upstream.body["token_ids"] + upstream.output_ids}
        views = await self._views()
        tried: set[str] = set()
        last_error: UpstreamError | None = None
        for _ in range(self.settings.max_attempts):
            try:
                view, decision = self.planner.plan_decode(views, handoff["kv_format"], len(body["token_ids"]),
                                                          frozenset(tried))
            except NoCandidate:
                break
            self.metrics.routing_decisions.labels(view.pool, view.hardware, str(decision.reason)).inc()
            worker = self.registry.workers[view.worker_id]
            tried.add(worker.worker_id)
            try:
                with tracing.span("worker.generate", kind="client", worker=worker.worker_id, attempt=len(tried),
                                  role="decode"):
                    leg, _ready, first = await self._open(worker, body, request_id)
            except UpstreamError as exc:
                last_error = exc
                self._failed(worker, exc, request_id)
                continue
            upstream.leg = leg
            upstream.series = self.metrics.request_series(upstream.first_series.model, worker.pool,
                                                          worker.spec.hardware)
            upstream.pending.append(first)
            return
        raise UpstreamError(UpstreamKind.WORKER_ERROR, f"no decode worker took the hand-off: {last_error or 'none compatible'}",
                            retryable=False)

    async def _relay(self, prepared: PreparedRequest, upstream: _Upstream, request_id: str,
                     arrival: float) -> AsyncIterator[bytes]:
        """The SSE body. Release and counting happen in `_close_stream`, which runs however the
        response ends, even when the client leaves before this generator ever starts."""
        response = upstream.response
        with tracing.span("stream.relay", worker=upstream.leg.worker.worker_id) as span:
            try:
                yield upstream.head
                last = time.perf_counter()
                upstream.first_series.ttft.observe(last - arrival)
                async for event in self._events(upstream, request_id):
                    if event["event"] == "tokens":
                        out = response.tokens(event["token_ids"], event.get("logprobs"))
                        now = time.perf_counter()
                        upstream.series.itl.observe(now - last)
                        last = now
                        if out:
                            yield out
                        if response.done:  # stop sequence: stop the engine too
                            break
                    else:
                        _raise_if_error(event)
                        yield response.finish(event["reason"])
                upstream.status = "200"
            except (UpstreamError, GatewayError) as exc:
                upstream.status = "502"
                self.registry.count_error(upstream.leg.worker,
                                          exc.kind if isinstance(exc, UpstreamError) else UpstreamKind.ENGINE)
                log.warning("request %s: stream from %s failed after the first token: %s", request_id,
                            upstream.leg.worker.worker_id, exc)
                yield stream_error_frame(prepared.protocol, f"The worker failed mid-stream: {exc}")
            span.set_attribute("completion_tokens", response.completion_tokens)
            span.set_attribute("status", upstream.status or "499")

    def _close_stream(self, prepared: PreparedRequest, upstream: _Upstream, request_id: str, arrival: float) -> None:
        if upstream.status is None:  # the client left before the end
            upstream.status = "499"
            self.metrics.client_disconnects.inc()
        self._finish(upstream, request_id)
        self._observe_done(upstream, arrival)
        self.metrics.requests.labels(str(prepared.protocol), prepared.model, upstream.status).inc()

    async def _drain(self, prepared: PreparedRequest, upstream: _Upstream, request_id: str) -> None:
        """Non-streaming: accumulate the whole answer. A failure raises UpstreamFailed, which the
        app renders and counts (once)."""
        response = upstream.response
        try:
            async for event in self._events(upstream, request_id):
                if event["event"] == "tokens":
                    response.tokens(event["token_ids"], event.get("logprobs"))
                    if response.done:
                        break
                else:
                    _raise_if_error(event)
                    response.finish(event["reason"])
        except UpstreamError as exc:
            raise UpstreamFailed(f"The worker failed mid-answer: {exc}") from None

    # --- bookkeeping ------------------------------------------------------------------------

    def _close_leg(self, leg: _Leg, request_id: str, abort: bool) -> None:
        if leg.closed:
            return
        leg.closed = True
        leg.worker.inflight -= 1
        self.metrics.inflight.dec()
        leg.stream.close()
        if abort:  # the dropped connection aborts too; this covers proxies that keep it open
            asyncio.get_running_loop().create_task(self.client.abort(leg.worker.url, request_id))

    def _finish(self, upstream: _Upstream, request_id: str) -> None:
        self._close_leg(upstream.leg, request_id, abort=not upstream.finished)
        if upstream.on_done is not None:
            on_done, upstream.on_done = upstream.on_done, None
            on_done(upstream.response.completion_tokens)

    def _observe_done(self, upstream: _Upstream, arrival: float) -> None:
        completion_tokens = upstream.response.completion_tokens
        self.metrics.generation_tokens.inc(completion_tokens)
        upstream.series.output_len.observe(completion_tokens)
        upstream.series.duration.observe(time.perf_counter() - arrival)


class _RelayResponse(StreamingResponse):
    """A streaming response whose bookkeeping runs when the response ends, whichever way:
    the body generator itself may be cancelled before its first line, or closed without
    a CancelledError while blocked in send()."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None], **kwargs: Any):
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def _raise_if_error(finish: dict[str, Any]) -> None:
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
