"""The request path after parsing: route -> worker -> relay tokens -> protocol response.

Retry rule: a failure before the first token reaches the client (connect error, 5xx,
timeout, a retryable engine error) is retried on another worker, up to `max_attempts`;
after the first token the stream ends with a protocol error event, never silently.
The client's response starts only once the first token is in hand, so every
pre-first-token failure can still become a retry or a proper HTTP error status.

Bookkeeping (in-flight counts, upstream connection, metrics) is released in `finally`
blocks owned by `_Upstream`, whichever way a request ends: finish, error, or the
client going away (Starlette cancels the body iterator, which closes the worker
connection; the worker aborts the engine request when its client disconnects).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from starlette.responses import Response, StreamingResponse

from deepinfer_gateway import protocol as wp
from deepinfer_gateway.gateway.errors import (
    GatewayError,
    NoHealthyWorker,
    UpstreamFailed,
    stream_error_frame,
)
from deepinfer_gateway.gateway.metrics import GatewayMetrics
from deepinfer_gateway.gateway.registry import WorkerRegistry, WorkerState
from deepinfer_gateway.gateway.worker_client import UpstreamError, WorkerClient, WorkerStream
from deepinfer_gateway.recipe_bridge.prepare import PreparedRequest
from deepinfer_gateway.recipe_bridge.stream import ID_PREFIX, ResponseStream
from deepinfer_gateway.recipe_bridge.tokenizer import TokenizerBundle
from deepinfer_gateway.router.policy import Candidate, Policy, RoutingView

log = logging.getLogger(__name__)

SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}
WORKER_HEADER = "x-dgw-worker"


@dataclass
class _Upstream:
    """One successful attempt: the worker, its open stream and the response being built."""

    worker: WorkerState
    stream: WorkerStream
    response: ResponseStream
    head: bytes  # protocol bytes produced so far (ready + first tokens), not yet sent
    finish: dict[str, Any] | None  # set when the whole answer arrived with the first message
    prompt_tokens: int
    released: bool = False
    on_done: Callable[[int], None] | None = None

    def release(self, client: WorkerClient, request_id: str, metrics: GatewayMetrics) -> None:
        if self.released:
            return
        self.released = True
        if self.on_done is not None:
            self.on_done(self.response.completion_tokens)
        self.worker.inflight -= 1
        metrics.inflight.dec()
        self.stream.close()
        if self.finish is None:  # not finished: make sure the engine stops too
            asyncio.get_running_loop().create_task(client.abort(self.worker.url, request_id))


class RequestServer:
    def __init__(self, registry: WorkerRegistry, client: WorkerClient, policy: Policy, bundle: TokenizerBundle,
                 metrics: GatewayMetrics, max_attempts: int):
        self.registry = registry
        self.client = client
        self.policy = policy
        self.bundle = bundle
        self.metrics = metrics
        self.max_attempts = max_attempts

    async def serve(self, prepared: PreparedRequest, request_id: str, arrival: float, *,
                    workload_class: str = "chat", headers: dict[str, str] | None = None,
                    on_done: Callable[[int], None] | None = None) -> Response:
        """`on_done(completion_tokens)` runs once when the request ends, however it ends."""
        response_id = ID_PREFIX[prepared.protocol] + uuid.uuid4().hex
        body = {
            "request_id": request_id,
            "token_ids": prepared.token_ids,
            "sampling": prepared.sampling.model_dump(by_alias=True, exclude_defaults=True),
            "role": "unified",
            "workload_class": workload_class,
        }
        upstream = await self._first_token(prepared, body, request_id, response_id)
        headers = {**(headers or {}), wp.REQUEST_ID_HEADER: request_id, WORKER_HEADER: upstream.worker.worker_id}
        upstream.on_done = on_done
        if prepared.stream:
            return StreamingResponse(self._relay(prepared, upstream, request_id, arrival),
                                     media_type="text/event-stream", headers={**SSE_HEADERS, **headers})
        try:
            await self._drain(prepared, upstream, request_id, arrival)
        finally:
            upstream.release(self.client, request_id, self.metrics)
        return Response(upstream.response.body(), media_type="application/json", headers=headers)

    # --- attempts ---------------------------------------------------------------------

    def _candidates(self, exclude: set[str]) -> list[WorkerState]:
        return [w for w in self.registry.healthy(wp.Role.UNIFIED) if w.worker_id not in exclude]

    def _choose(self, prepared: PreparedRequest, workers: list[WorkerState]) -> WorkerState:
        view = RoutingView(
            prompt_tokens=len(prepared.token_ids),
            candidates=tuple(
                Candidate(worker_id=w.worker_id, hardware=str(w.spec.hardware), pool=w.pool, kv_format=w.kv_format,
                          queued_prefill_tokens=(w.load.queued_prefill_tokens if w.load else 0)
                          + w.inflight_prefill_tokens,
                          running=(w.load.running if w.load else 0) + w.inflight)
                for w in workers),
            session_key=prepared.user,
        )
        decision = self.policy.choose(view)
        self.policy.observe(view, decision)
        chosen = next(w for w in workers if w.worker_id == decision.worker_id)
        self.metrics.routing_decisions.labels(chosen.pool, str(chosen.spec.hardware), str(decision.reason)).inc()
        return chosen

    async def _first_token(self, prepared: PreparedRequest, body: dict[str, Any], request_id: str,
                           response_id: str) -> _Upstream:
        tried: set[str] = set()
        last_error: UpstreamError | None = None
        for _ in range(self.max_attempts):
            workers = self._candidates(tried)
            if not workers:
                break
            worker = self._choose(prepared, workers)
            tried.add(worker.worker_id)
            try:
                return await self._attempt(prepared, worker, body, request_id, response_id)
            except UpstreamError as exc:
                last_error = exc
                self.metrics.upstream_errors.labels(worker.worker_id, exc.kind).inc()
                if exc.kind in ("connect", "timeout", "http_status"):
                    self.registry.record_failure(worker, str(exc), eject_now=exc.kind == "connect")
                if not exc.retryable:
                    raise GatewayError(str(exc), status_code=exc.status or 400) from None
                self.metrics.retries.labels(exc.kind).inc()
                log.warning("request %s: attempt on %s failed (%s), retrying", request_id, worker.worker_id, exc)
        if last_error is None:
            raise NoHealthyWorker("No healthy worker is available to serve this request; retry shortly.")
        raise UpstreamFailed(f"All {len(tried)} attempted workers failed: {last_error}")

    async def _attempt(self, prepared: PreparedRequest, worker: WorkerState, body: dict[str, Any],
                       request_id: str, response_id: str) -> _Upstream:
        worker.inflight += 1
        worker.inflight_prefill_tokens += len(prepared.token_ids)
        self.metrics.inflight.inc()
        stream: WorkerStream | None = None
        try:
            stream = await self.client.generate(worker.url, body, request_id)
            ready = await stream.next_event()
            if ready is None or ready["event"] != "ready":
                raise UpstreamError("protocol", f"worker {worker.worker_id} did not start with a ready event")
            cached = ready["cached_tokens"]
            response = ResponseStream(prepared, self.bundle, response_id)
            head = response.ready(ready["prompt_tokens"], cached["memory"] + cached["store"])
            first = await stream.next_event()
            if first is None:
                raise UpstreamError("protocol", f"worker {worker.worker_id} closed the stream before a token")
            finish = None
            if first["event"] == "finish":
                _raise_if_error(first)
                finish = first
            elif first["event"] == "tokens":
                head += response.tokens(first["token_ids"], first.get("logprobs"))
            self._count_prompt(ready)
            self.registry.record_success(worker)
            return _Upstream(worker, stream, response, head, finish, ready["prompt_tokens"])
        except BaseException:
            worker.inflight -= 1
            self.metrics.inflight.dec()
            if stream is not None:
                stream.close()
            raise
        finally:
            worker.inflight_prefill_tokens -= len(prepared.token_ids)

    def _count_prompt(self, ready: dict[str, Any]) -> None:
        self.metrics.prompt_tokens.inc(ready["prompt_tokens"])
        for tier, n in ready["cached_tokens"].items():
            if n:
                self.metrics.cached_tokens.labels(tier).inc(n)

    # --- after the first token ----------------------------------------------------------

    async def _events(self, upstream: _Upstream) -> AsyncIterator[dict[str, Any]]:
        if upstream.finish is not None:
            yield upstream.finish
            return
        async for event in upstream.stream.events():
            yield event
            if event["event"] == "finish":
                upstream.finish = event
                return
        raise UpstreamError("protocol", f"worker {upstream.worker.worker_id} ended the stream without finishing")

    async def _relay(self, prepared: PreparedRequest, upstream: _Upstream, request_id: str,
                     arrival: float) -> AsyncIterator[bytes]:
        response = upstream.response
        status = "200"
        try:
            yield upstream.head
            last = time.perf_counter()
            self.metrics.ttft.observe(last - arrival)
            async for event in self._events(upstream):
                if event["event"] == "tokens":
                    out = response.tokens(event["token_ids"], event.get("logprobs"))
                    now = time.perf_counter()
                    self.metrics.itl.observe(now - last)
                    last = now
                    if out:
                        yield out
                    if response.done:  # stop sequence: stop the engine too
                        break
                elif event["event"] == "finish":
                    _raise_if_error(event)
                    yield response.finish(event["reason"])
        except (UpstreamError, GatewayError) as exc:
            status = "502"
            self.metrics.upstream_errors.labels(upstream.worker.worker_id, getattr(exc, "kind", "engine")).inc()
            log.warning("request %s: stream from %s failed after the first token: %s", request_id,
                        upstream.worker.worker_id, exc)
            yield stream_error_frame(prepared.protocol, f"The worker failed mid-stream: {exc}")
        except asyncio.CancelledError:
            status = "499"
            self.metrics.client_disconnects.inc()
            raise
        finally:
            upstream.release(self.client, request_id, self.metrics)
            self._count_done(prepared, response, status, arrival)

    async def _drain(self, prepared: PreparedRequest, upstream: _Upstream, request_id: str, arrival: float) -> None:
        response = upstream.response
        status = "200"
        try:
            async for event in self._events(upstream):
                if event["event"] == "tokens":
                    response.tokens(event["token_ids"], event.get("logprobs"))
                    if response.done:
                        break
                else:
                    _raise_if_error(event)
                    response.finish(event["reason"])
            self.metrics.ttft.observe(time.perf_counter() - arrival)
        except UpstreamError as exc:
            status = "502"
            raise UpstreamFailed(f"The worker failed mid-answer: {exc}") from None
        finally:
            self._count_done(prepared, response, status, arrival)

    def _count_done(self, prepared: PreparedRequest, response: ResponseStream, status: str, arrival: float) -> None:
        self.metrics.generation_tokens.inc(response.completion_tokens)
        self.metrics.duration.observe(time.perf_counter() - arrival)
        self.metrics.requests.labels(str(prepared.protocol), prepared.model, status).inc()


def _raise_if_error(finish: dict[str, Any]) -> None:
    error = finish.get("error")
    if finish.get("reason") == wp.FinishReason.ERROR or error:
        error = error or {}
        kind = error.get("kind", "engine")
        retryable = bool(error.get("retryable", False))
        status = 400 if kind in {str(k) for k in wp.CLIENT_ERRORS} else 503
        raise UpstreamError("worker_error", f"{kind}: {error.get('message', 'engine error')}", retryable=retryable,
                            status=status)
    if finish.get("reason") == wp.FinishReason.ABORT:
        raise UpstreamError("worker_error", "the worker aborted the request", retryable=True, status=503)
