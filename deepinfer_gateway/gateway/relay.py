"""After the first token: relay the worker's events as the client's protocol.

A streamed request is relayed as SSE by `Relay.stream` inside a `RelayResponse`; a
non-streamed one is drained into one JSON body by `Relay.drain`. A failure after a token
reached the client ends the stream with a protocol error event, never silently.

`Relay.close` ends a request that reached a worker, whichever way it ends (finish,
error, the client going away): it releases the current leg's lease, runs the request's
`on_done` (rate-limit debit), observes its end and records its outcome and its prompt
and cached tokens (at the end: an engine that reports its cached count only then, vLLM,
brings it on `finish`, and `ResponseStream.finish` corrects the final usage with it). It is
idempotent: its owner calls it in one `finally`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.responses import StreamingResponse

from deepinfer_gateway import tracing
from deepinfer_gateway.errors import GatewayError, UpstreamError, UpstreamFailed, UpstreamKind
from deepinfer_gateway.gateway.error_json import stream_error_frame
from deepinfer_gateway.gateway.legs import Lease, Legs, raise_if_error
from deepinfer_gateway.gateway.metrics import GatewayMetrics, RequestSeries
from deepinfer_gateway.recipe_bridge.prepare import PreparedRequest
from deepinfer_gateway.recipe_bridge.stream import ResponseStream
from deepinfer_gateway.router.planner import Plan

log = logging.getLogger(__name__)


@dataclass
class Upstream:
    """A request past its first token: the current leg and the response being built."""

    prepared: PreparedRequest
    request_id: str
    arrival: float  # perf_counter at arrival: TTFT, queue time and duration start here
    lease: Lease  # the current leg's
    plan: Plan
    body: dict[str, Any]  # the worker request body (a decode leg continues it)
    ready: dict[str, Any]  # the first leg's `ready`; its cached count the final one once `finish` brings it
    response: ResponseStream
    first_series: RequestSeries  # the first leg's (model, pool, hardware): TTFT, queue time, prompt length
    series: RequestSeries  # the current leg's: ITL, duration, output length
    on_done: Callable[[int], None] | None = None  # runs once at the end with the completion tokens
    head: bytes = b""  # protocol bytes produced so far (ready + first tokens), not yet sent
    pending: list[dict[str, Any]] = field(default_factory=list)  # events read ahead of the relay
    output_ids: list[int] = field(default_factory=list)  # tokens so far (PD plans: the decode leg continues them)
    finished: bool = False  # the worker finished the request: nothing to abort
    status: str | None = None  # the outcome once known: 200, 502 (streams; 499: the client left first)
    closed: bool = False


def final_cached(finish: dict[str, Any]) -> int | None:
    """The cached prompt tokens a `finish` reports (engines that know them only at the end)."""
    cached = finish.get("cached_tokens")
    return None if cached is None else cached["memory"] + cached["store"]


class Relay:
    def __init__(self, legs: Legs, metrics: GatewayMetrics):
        self.legs = legs
        self.metrics = metrics

    async def events(self, upstream: Upstream) -> AsyncIterator[dict[str, Any]]:
        """The request's token and finish events across its legs (a PD hand-off is followed here)."""
        pending = upstream.pending
        keep_ids = upstream.plan.mode == "pd"  # only a decode leg continues from them
        while True:
            event: dict[str, Any] | None
            if pending:
                event = pending.pop(0)
            else:
                stream = upstream.lease.stream  # set once a leg is open; read per event: a hand-off swaps it
                assert stream is not None
                event = await stream.next_event()
            if event is None:
                raise UpstreamError(UpstreamKind.PROTOCOL,
                                    f"worker {upstream.lease.worker.worker_id} ended the stream early")
            if event["event"] == "tokens":
                if keep_ids:
                    upstream.output_ids.extend(event["token_ids"])
                yield event
            elif event["event"] == "finish":
                handoff = event.get("kv_handoff")
                if handoff is None or upstream.plan.mode != "pd":
                    upstream.finished = True
                    if "cached_tokens" in event:  # the real count where `ready`'s was provisional (vLLM)
                        upstream.ready = {**upstream.ready, "cached_tokens": event["cached_tokens"]}
                    yield event
                    return
                await self._hand_off(upstream, handoff)
            # a decode leg's own `ready` carries no prompt usage of interest: skip it

    async def _hand_off(self, upstream: Upstream, handoff: dict[str, Any]) -> None:
        """Prefill finished with a KV hand-off: continue on a compatible decode worker."""
        upstream.lease.release(abort=False)
        body = {**upstream.body, "role": "decode", "kv_handoff": handoff,
                "token_ids": upstream.body["token_ids"] + upstream.output_ids}
        lease, first = await self.legs.decode(body, handoff["kv_format"], upstream.request_id)
        upstream.lease = lease
        upstream.series = self.metrics.request_series(upstream.first_series.model, lease.worker.pool,
                                                      lease.worker.spec.hardware)
        upstream.pending.append(first)

    async def stream(self, upstream: Upstream) -> AsyncIterator[bytes]:
        """The SSE body. Its end is recorded by `RelayResponse`, which runs however the response
        ends, even when the client leaves before this generator ever starts."""
        response = upstream.response
        with tracing.span("stream.relay", worker=upstream.lease.worker.worker_id) as span:
            try:
                yield upstream.head
                last = time.perf_counter()
                upstream.first_series.ttft.observe(last - upstream.arrival)
                async for event in self.events(upstream):
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
                        raise_if_error(event)
                        yield response.finish(event["reason"], final_cached(event))
                upstream.status = "200"
            except (UpstreamError, GatewayError) as exc:
                upstream.status = "502"
                self.legs.registry.count_error(upstream.lease.worker,
                                               exc.kind if isinstance(exc, UpstreamError) else UpstreamKind.ENGINE)
                log.warning("request %s: stream from %s failed after the first token: %s", upstream.request_id,
                            upstream.lease.worker.worker_id, exc)
                yield stream_error_frame(upstream.prepared.protocol, f"The worker failed mid-stream: {exc}")
            span.set_attribute("completion_tokens", response.completion_tokens)
            span.set_attribute("status", upstream.status or "499")

    async def drain(self, upstream: Upstream) -> None:
        """Non-streaming: accumulate the whole answer. A failure raises UpstreamFailed, which the
        app renders and counts."""
        response = upstream.response
        try:
            async for event in self.events(upstream):
                if event["event"] == "tokens":
                    response.tokens(event["token_ids"], event.get("logprobs"))
                    if response.done:
                        break
                else:
                    raise_if_error(event)
                    response.finish(event["reason"], final_cached(event))
        except UpstreamError as exc:
            raise UpstreamFailed(f"The worker failed mid-answer: {exc}") from None
        upstream.status = "200"

    def close(self, upstream: Upstream) -> None:
        """The end of a request that reached a worker; only the first call acts. A status left
        unset is an error the app answers and counts itself."""
        if upstream.closed:
            return
        upstream.closed = True
        try:
            upstream.lease.release(abort=not upstream.finished)
            if upstream.on_done is not None:
                upstream.on_done(upstream.response.completion_tokens)
        finally:
            tokens = upstream.response.completion_tokens
            self.metrics.generation_tokens.inc(tokens)
            upstream.series.output_len.observe(tokens)
            upstream.series.duration.observe(time.perf_counter() - upstream.arrival)
            if upstream.status is not None:
                self.metrics.count_request(str(upstream.prepared.protocol), upstream.prepared.model, upstream.status)
            self.legs.routing.count_prompt(upstream.plan, upstream.ready)  # at the end: the final cached count

    def close_stream(self, upstream: Upstream) -> None:
        if upstream.status is None:  # the client left before the end
            upstream.status = "499"
            self.metrics.client_disconnects.inc()
        self.close(upstream)


class RelayResponse(StreamingResponse):
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
