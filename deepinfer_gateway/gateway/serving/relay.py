"""After the first token: relay the worker's events as the client's protocol.

A streamed request is relayed as SSE by `Relay.stream` inside a `RelayResponse`; a
non-streamed one is drained into one JSON body by `Relay.drain`; both run one loop over
the worker's events. A failure after a token reached the client ends the stream with a
protocol error event, never silently.

One worker `tokens` event (one engine step, however many tokens) becomes one protocol
chunk (recipe_bridge/stream.py). Writes are coalesced: a chunk is sent when the next event
is not already in hand (`EventStream.buffered`); while one is, its chunk joins the unsent
ones and they go out in one write. A client that lags (its write waits for the socket to
drain) therefore gets everything the worker sent meanwhile in one write, not one per
step; a stream whose worker stays ahead is still written every MAX_COALESCED_BYTES.

The direct path (worker protocol v2): while the relay's task waits for its stream's next
event, the stream's `sink` (`_sink`) takes each `tokens` event in the connection reader's
own call and frames and writes its chunk there, as the loop would; so one engine step costs
no future, no task switch and no coroutine chain per stream. What it cannot finish there it
hands back to the task, which carries on in the loop: a write that must wait for a slow
client (`_take_back` finishes it, then coalescing applies as above), an exception, the
answer ended by a stop sequence. Every other event (`finish`, errors) goes to the task.

`Relay.close` ends a request that reached a worker, whichever way it ends (finish,
error, the client going away): it releases the current leg's lease, runs the request's
`on_done` (rate-limit refund) and ends its `RequestOutcome` (outcome.py: every metric of
the request, recorded there). It is idempotent: its owner calls it in one `finally`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import types
from collections.abc import Awaitable, Callable, Generator, Mapping
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import ClientDisconnect
from starlette.responses import Response
from starlette.types import Receive, Send

from deepinfer_gateway.core import tracing
from deepinfer_gateway.core.errors import GatewayError, UpstreamError, UpstreamFailed, UpstreamKind
from deepinfer_gateway.gateway.fleet.registry import WorkerRegistry
from deepinfer_gateway.gateway.serving.error_json import stream_error_frame
from deepinfer_gateway.gateway.serving.legs import Lease, Legs, raise_if_error
from deepinfer_gateway.gateway.serving.outcome import RequestOutcome
from deepinfer_gateway.gateway.upstream.base import RELAYED, LegRequest, Sink, direct
from deepinfer_gateway.recipe_bridge.prepare import PreparedRequest
from deepinfer_gateway.recipe_bridge.stream import AnyResponseStream

log = logging.getLogger(__name__)

MAX_COALESCED_BYTES = 16384  # a write at least this often, even while events keep arriving


@dataclass(eq=False)
class Exchange:
    """A request past its first token: its leg request, the current leg, the response being
    built and its outcome (every metric). Built by keyword (server.py)."""

    prepared: PreparedRequest
    leg: LegRequest  # the request as its legs get it (a decode leg continues it)
    lease: Lease  # the current leg's
    response: AnyResponseStream
    outcome: RequestOutcome
    keep_ids: bool  # a PD plan: a decode leg continues from the tokens so far
    on_done: Callable[[int], None] | None = None  # runs once at the end with the completion tokens
    head: bytes = b""  # protocol bytes produced so far (ready + first tokens), not yet sent
    pending: list[dict[str, Any]] = field(default_factory=list)  # events read ahead of the relay
    output_ids: list[int] = field(default_factory=list)  # tokens so far (PD plans: the decode leg continues them)
    unsent: list[bytes] = field(default_factory=list)  # streaming: chunks produced, not yet written (coalescing)
    last_token_at: float = 0.0  # perf_counter of the last token message relayed (ITL)
    sink: Sink | None = None  # streaming over v2: the direct path (module doc)
    sink_error: BaseException | None = None  # raised by the direct path: the relay's task raises it
    sink_write: tuple[Any, Any] | None = None  # a write the direct path could not finish at once
    finished: bool = False  # the worker finished the request: nothing to abort
    closed: bool = False


def final_cached(finish: dict[str, Any]) -> int | None:
    """The cached prompt tokens a `finish` reports (engines that know them only at the end)."""
    cached = finish.get("cached_tokens")
    return None if cached is None else cached["memory"] + cached["store"]


class Relay:
    def __init__(self, legs: Legs, registry: WorkerRegistry):
        self.legs = legs
        self.registry = registry

    def stream(self, exchange: Exchange) -> Callable[[Send], Awaitable[None]]:
        """The SSE body, as what `RelayResponse` runs with the ASGI `send`. Its end is recorded
        by `RelayResponse`, which runs however the response ends, even when the client leaves
        before the body starts."""
        return functools.partial(self._stream, exchange)

    async def _stream(self, exchange: Exchange, send: Send) -> None:
        response, outcome = exchange.response, exchange.outcome
        with tracing.span("stream.relay", worker=exchange.lease.worker.worker_id) as span:
            try:
                await send({"type": "http.response.body", "body": exchange.head, "more_body": True})
                exchange.last_token_at = last = time.perf_counter()
                outcome.first_token(last)
                exchange.sink = functools.partial(_sink, exchange, send)
                await self._relay(exchange, send)
                outcome.status = "200"
            except (UpstreamError, GatewayError) as exc:
                outcome.status = "502"
                self.registry.count_error(exchange.lease.worker,
                                          exc.kind if isinstance(exc, UpstreamError) else UpstreamKind.ENGINE)
                log.warning("request %s: stream from %s failed after the first token: %s", exchange.leg.request_id,
                            exchange.lease.worker.worker_id, exc)
                said = exc.detail if isinstance(exc, UpstreamError) else exc.message  # the log has the address
                frame = stream_error_frame(exchange.prepared.protocol, f"The worker failed mid-stream: {said}")
                exchange.unsent.append(frame)  # after what the client was not sent yet
                await _flush(exchange.unsent, send)
            span.set_attribute("completion_tokens", response.completion_tokens)
            span.set_attribute("status", outcome.status or "499")

    async def drain(self, exchange: Exchange) -> None:
        """Non-streaming: accumulate the whole answer. A failure raises UpstreamFailed, which the
        app renders and counts."""
        try:
            await self._relay(exchange, None)
        except UpstreamError as exc:
            log.warning("request %s: answer from %s failed: %s", exchange.leg.request_id,
                        exchange.lease.worker.worker_id, exc)
            raise UpstreamFailed(f"The worker failed mid-answer: {exc.detail}") from None
        exchange.outcome.status = "200"

    async def _relay(self, exchange: Exchange, send: Send | None) -> None:
        """Turn the request's events, across its legs (a PD hand-off is followed here), into
        `exchange.response`. With `send` (streaming), the protocol chunks are written as they
        are produced, coalesced (module doc), and the gap between token messages observed
        (ITL, the first one from `last`); without it (drain), the response only accumulates.
        One loop for both and no generator in between: it runs once per relayed event."""
        response, outcome = exchange.response, exchange.outcome
        pending = exchange.pending
        keep_ids = exchange.keep_ids
        unsent = exchange.unsent
        size = 0  # of `unsent`
        while True:
            event: dict[str, Any] | None
            if pending:
                event = pending.pop(0)
            else:
                stream = exchange.lease.stream  # set once a leg is open; read per event: a hand-off swaps it
                assert stream is not None
                if unsent and (size >= MAX_COALESCED_BYTES or not stream.buffered()):
                    assert send is not None
                    size = 0
                    await _flush(unsent, send)  # the next read may wait: the client gets what there is
                if exchange.sink is not None:
                    capable = direct(stream)
                    if capable is not None and capable.sink is None:
                        capable.sink = exchange.sink  # until it hands the stream back (module doc)
                event = await stream.next_event()
                if event is RELAYED:  # the direct path relayed up to here, and hands back
                    await _take_back(exchange)
                    if response.done:
                        return
                    continue
            if event is None:
                raise UpstreamError(UpstreamKind.PROTOCOL,
                                    f"worker {exchange.lease.worker.worker_id} ended the stream early")
            kind = event["event"]
            if kind == "tokens":
                out = _tokens(exchange, event, send is not None)
                if send is not None:
                    if out:
                        current = exchange.lease.stream
                        if unsent or pending or (current is not None and current.buffered()):
                            unsent.append(out)  # more in hand: written with it, at the loop's top
                            size += len(out)
                        else:  # the usual case, written at once (no list, no flush call)
                            await send({"type": "http.response.body", "body": out, "more_body": True})
                if response.done:  # stop sequence: stop the engine too
                    if unsent:
                        assert send is not None
                        await _flush(unsent, send)
                    return
            elif kind == "finish":
                handoff = event.get("kv_handoff")
                if handoff is None or not keep_ids:
                    exchange.finished = True
                    if "cached_tokens" in event:  # the real count where `ready`'s was provisional (vLLM)
                        outcome.final_cached(event["cached_tokens"])
                    raise_if_error(event)
                    out = response.finish(event["reason"], final_cached(event))
                    if send is not None:
                        unsent.append(out)
                        await _flush(unsent, send)
                    return
                if unsent:  # opening the decode leg takes a while
                    assert send is not None
                    size = 0
                    await _flush(unsent, send)
                await self._hand_off(exchange, handoff)
            # a decode leg's own `ready` carries no prompt usage of interest: skip it

    async def _hand_off(self, exchange: Exchange, handoff: dict[str, Any]) -> None:
        """Prefill finished with a KV hand-off: continue on a compatible decode worker."""
        lease, first = await self.legs.hand_off(exchange.lease, exchange.leg, handoff, exchange.output_ids)
        exchange.lease = lease
        exchange.outcome.decode_leg(lease.worker)
        exchange.pending.append(first)

    def close(self, exchange: Exchange) -> None:
        """The end of a request that reached a worker; only the first call acts. An outcome
        status left unset is an error the app answers and counts itself."""
        if exchange.closed:
            return
        exchange.closed = True
        try:
            exchange.lease.release(abort=not exchange.finished)
            if exchange.on_done is not None:
                exchange.on_done(exchange.response.completion_tokens)
        finally:
            exchange.outcome.end(exchange.response.completion_tokens)

    def close_stream(self, exchange: Exchange) -> None:
        exchange.outcome.client_left()  # unless the stream reached its end
        self.close(exchange)


def _tokens(exchange: Exchange, event: dict[str, Any], streaming: bool) -> bytes:
    """A `tokens` event into the response (the relay loop's and the direct path's one step):
    its protocol chunk (empty when it frames nothing yet); streaming, the gap since the last
    token message is observed (ITL)."""
    token_ids = event["token_ids"]
    if exchange.keep_ids:
        exchange.output_ids.extend(token_ids)
    out = exchange.response.tokens(token_ids, event.get("logprobs"))
    if streaming:
        now = time.perf_counter()
        exchange.outcome.itl.observe(now - exchange.last_token_at)
        exchange.last_token_at = now
    return out


def _sink(exchange: Exchange, send: Send, event: dict[str, Any]) -> bool:
    """The direct path (module doc): one `tokens` event framed and written in the v2 reader's
    call, exactly as `Relay._relay`'s loop would; False (not taken) for any other event. What
    needs the relay's task (a write that must wait for the client, an error, the answer
    ended by a stop sequence) is handed back to it after this event."""
    if event["event"] != "tokens":
        return False
    stream = direct(exchange.lease.stream) if exchange.lease.stream is not None else None
    assert stream is not None
    try:
        out = _tokens(exchange, event, True)
        if out:
            # Its iterator, stepped with next(): uvicorn's `send` is a coroutine, granian's another
            # awaitable whose iterator has no `send`.
            write = send({"type": "http.response.body", "body": out, "more_body": True}).__await__()
            try:
                # ASGI servers write at once unless the client's socket is full: then `send`
                # waits on a future, and the relay's task finishes it (`_take_back`).
                waiting_on = next(write)
            except StopIteration:
                pass
            else:
                exchange.sink_write = (write, waiting_on)
                stream.hand_back()
                return True
    except Exception as exc:  # raised in the relay's task, as its own loop would have
        exchange.sink_error = exc
        stream.hand_back()
        return True
    if exchange.response.done:
        stream.hand_back()
    return True


async def _take_back(exchange: Exchange) -> None:
    """The relay's task after the direct path handed back: finish its unfinished write
    (await what `send` waits on, then resume it), raise its error."""
    if exchange.sink_write is not None:
        write, waiting_on = exchange.sink_write
        exchange.sink_write = None
        try:
            await _resume(write, waiting_on)
        finally:
            close = getattr(write, "close", None)  # a no-op once finished; ends it if this task was cancelled
            if close is not None:
                close()
    if exchange.sink_error is not None:
        error, exchange.sink_error = exchange.sink_error, None
        raise error


@types.coroutine
def _resume(steps: Any, waiting_on: Any) -> Generator[Any, Any, None]:
    """Run an awaitable started elsewhere (`steps`: its `__await__()` iterator) to its end
    in this task: what it waits on (as it yielded it to its caller) goes to the task, results
    and exceptions back into it. `await` cannot take it over: a coroutine suspended in an await
    counts as awaited already."""
    while True:
        try:
            yield waiting_on
        except BaseException as exc:  # the task's cancellation: into the write, where it waits
            try:
                waiting_on = steps.throw(exc)
            except StopIteration:
                return
        else:
            try:
                waiting_on = next(steps)
            except StopIteration:
                return


async def _flush(unsent: list[bytes], send: Send) -> None:
    """Write the unsent chunks as one body message, and forget them."""
    body = unsent[0] if len(unsent) == 1 else b"".join(unsent)
    unsent.clear()
    await send({"type": "http.response.body", "body": body, "more_body": True})


class RelayResponse(Response):
    """A relayed stream's SSE response whose bookkeeping (`on_close`) runs when it ends,
    whichever way: finished, failed, or the client gone (even before the body starts).

    A plain ASGI app rather than Starlette's StreamingResponse, which per stream starts an
    anyio task group and runs the body in a child task through an async iterator: here the
    body writes its chunks itself (`Relay.stream`) in the request's own task. It detects a
    client leaving as StreamingResponse does: with ASGI spec >= 2.4, `send` raising OSError
    (re-raised as ClientDisconnect); before, an `http.disconnect` from `receive`, awaited by
    one watcher task that cancels the body (uvicorn's `send` drops writes to a gone client
    without raising)."""

    def __init__(self, body: Callable[[Send], Awaitable[None]], on_close: Callable[[], None], *,
                 media_type: str | None = None, headers: Mapping[str, str] | None = None):
        self.body_writer = body
        self._on_close = on_close
        self.status_code = 200
        self.media_type = media_type
        self.background = None
        self.init_headers(headers)
        self._client_gone = False

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        watcher: asyncio.Future[None] | None = None
        try:
            spec_version = scope.get("asgi", {}).get("spec_version", "2.0")
            if tuple(map(int, spec_version.split("."))) >= (2, 4):
                try:
                    await self._respond(send)
                except OSError:
                    raise ClientDisconnect() from None
                return
            task = asyncio.current_task()
            assert task is not None
            watcher = asyncio.ensure_future(self._cancel_on_disconnect(receive, task))
            try:
                await self._respond(send)
            except asyncio.CancelledError:
                # The watcher's cancellation ends the response quietly (as StreamingResponse's
                # task group does); any other, or one on top of it, goes on.
                if not self._client_gone or task.uncancel() > 0:
                    raise
        finally:
            if watcher is not None:
                # Synchronous after the body's last await: a watcher that has not run yet never
                # will, so it cannot cancel this task once the response is complete.
                watcher.cancel()
            self._on_close()

    async def _respond(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        await self.body_writer(send)
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _cancel_on_disconnect(self, receive: Receive, task: asyncio.Task[Any]) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self._client_gone = True
        task.cancel()
