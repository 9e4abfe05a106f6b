"""Worker protocol v2 on the worker: one WebSocket carrying every request of one gateway.

The gateway sends ops (`generate`, `abort`; a JSON array of them per message) and reads
request-tagged events back (`[[request_id, event], ...]` per message,
docs/worker-protocol.md "v2"). Each request runs the engine's own `generate` iterator in a
task of the connection (`_pump`), exactly as a v1 reply does, and the pumps put their
events in one outbox. The writer sends the outbox as one message when it wakes: every pump
woken by one engine step runs before it, so a step of N running requests is one message,
not N.

Scope-bound, like v1: an `abort` op, or the connection closing (a gateway that went away),
cancels the request's task, which closes the engine's iterator, which aborts the request
in the engine; nothing outlives the connection.

A bad op is answered in the protocol's own terms: an op naming a request gets that
request's `finish` with an `invalid_request` error; a message that is not a JSON array of
ops closes the connection with 1007 (invalid payload) and the reason.

A worker with a token checks it again at every `generate` op: a connection opened with a
token that a rotation has since removed gets no new requests (each such op is answered
with `finish` `unauthorized`), while the requests already running on it finish.

Pushes: a gateway that offers protocol.MUX_PUSH_SUBPROTOCOL in the upgrade gets it
selected, and may then subscribe to the KV event log (`kv_subscribe`) and the load report
(`load_subscribe`); their messages (objects, not the events' arrays) leave through the
same writer as the events (workers/pushes.py). A `load` message carries `ops`, the
`generate` ops read on this connection when it was sampled: the gateway learns which of
its requests the report counts.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from contextlib import AbstractContextManager, aclosing, nullcontext
from typing import Annotated, Any

import orjson
from pydantic import Field, TypeAdapter, ValidationError
from starlette.websockets import WebSocket, WebSocketDisconnect

from deepinfer_gateway.core.protocol import (
    MUX_PUSH_SUBPROTOCOL,
    SPANS_SCOPE_KEY,
    AbortOp,
    ErrorKind,
    FinishReason,
    GenerateOp,
    GenerateRequest,
    KvEventBatch,
    KvSubscribeOp,
    LoadReport,
    LoadSubscribeOp,
    finish_event,
)
from deepinfer_gateway.workers.engine import Engine
from deepinfer_gateway.workers.pushes import Activity, push_kv_events, push_load

log = logging.getLogger(__name__)

INVALID_PAYLOAD = 1007  # RFC 6455: a message that does not fit the protocol
SPAN_NAME = "v2 generate"  # one server span per request, as v1's `POST /v1/worker/generate`

_OPS: TypeAdapter[GenerateOp | AbortOp | KvSubscribeOp | LoadSubscribeOp] = TypeAdapter(
    Annotated[GenerateOp | AbortOp | KvSubscribeOp | LoadSubscribeOp, Field(discriminator="op")])


class MuxSession:
    """One gateway's connection: its requests' pumps and the outbox they share."""

    def __init__(self, engine: Engine, websocket: WebSocket, authorized: Callable[[], bool] | None = None,
                 activity: Activity | None = None):
        """`activity`: the worker's open requests, shared with its v1 endpoint (pushes.py)."""
        self._engine = engine
        self._ws = websocket
        self._authorized = authorized
        self._activity = activity or Activity()
        self._pumps: dict[str, asyncio.Task[None]] = {}
        self._outbox: list[tuple[str, dict[str, Any]]] = []
        self._pushes: list[bytes] = []  # push messages, sent after the events by the writer
        self._pushers: dict[str, asyncio.Task[None]] = {}  # "kv_events", "load"
        self._generate_ops = 0
        self._wake = asyncio.Event()
        # A tracing middleware's span factory (tracing.ServerSpans), if any.
        self._span: Callable[..., AbstractContextManager[Any]] = websocket.scope.get(SPANS_SCOPE_KEY, _no_span)

    async def run(self) -> None:
        pushes = MUX_PUSH_SUBPROTOCOL in self._ws.scope.get("subprotocols", ())
        await self._ws.accept(subprotocol=MUX_PUSH_SUBPROTOCOL if pushes else None)
        writer = asyncio.create_task(self._write())
        try:
            await self._read()
        finally:
            pumps = list(self._pumps.values()) + list(self._pushers.values())
            for task in pumps:
                task.cancel()  # each closes its engine iterator: the engine aborts the request
            await asyncio.gather(*pumps, return_exceptions=True)
            writer.cancel()
            await asyncio.gather(writer, return_exceptions=True)

    async def _read(self) -> None:
        while True:
            message = await self._ws.receive()
            if message["type"] == "websocket.disconnect":
                return
            data = message.get("bytes") or message.get("text")
            try:
                ops = orjson.loads(data) if data else None
            except orjson.JSONDecodeError:
                ops = None
            if not isinstance(ops, list):
                await self._ws.close(INVALID_PAYLOAD, "a message is a JSON array of ops")
                return
            for raw in ops:
                if not self._handle(raw):
                    await self._ws.close(INVALID_PAYLOAD, f"not an op: {str(raw)[:80]}")
                    return

    def _handle(self, raw: Any) -> bool:
        """Start or abort one request; False when `raw` names no request (the connection ends)."""
        try:
            op = _OPS.validate_python(raw)
        except ValidationError as err:
            request_id = _request_id(raw)
            if request_id is None:
                return False
            message = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors()[:5])
            self._emit(request_id, finish_event(FinishReason.ERROR, error_kind=ErrorKind.INVALID_REQUEST,
                                                message=f"invalid generate op: {message}"))
            return True
        if isinstance(op, AbortOp):
            task = self._pumps.get(op.request_id)
            if task is not None:
                task.cancel()
            return True
        if isinstance(op, KvSubscribeOp):
            sub = op.sub
            self._start_pusher("kv_events", push_kv_events(
                self._engine, op.after, op.limit, op.interval_ms / 1000,
                lambda batch: self._push({"push": "kv_events", "sub": sub, "batch": batch})))
            return True
        if isinstance(op, LoadSubscribeOp):
            self._start_pusher("load", push_load(self._engine, self._activity, op.interval_ms / 1000,
                                                 lambda: self._generate_ops, self._push_load))
            return True
        self._generate_ops += 1
        request = op.request
        rid = request.request_id
        if self._authorized is not None and not self._authorized():
            self._emit(rid, finish_event(FinishReason.ERROR, error_kind=ErrorKind.UNAUTHORIZED,
                                         message="this connection's worker token is no longer accepted"))
        elif rid in self._pumps:
            self._emit(rid, finish_event(FinishReason.ERROR, error_kind=ErrorKind.INVALID_REQUEST,
                                         message=f"request {rid!r} is already in flight on this connection"))
        else:
            self._pumps[rid] = asyncio.create_task(self._pump(request, op.trace))
        return True

    def _start_pusher(self, name: str, coro: Any) -> None:
        """Run a pusher, replacing the one of that name (a new subscription restarts it)."""
        previous = self._pushers.pop(name, None)
        if previous is not None:
            previous.cancel()
        self._pushers[name] = asyncio.create_task(coro, name=f"mux-push-{name}")

    def _push_load(self, report: LoadReport) -> None:
        self._push({"push": "load", "ops": self._generate_ops, "report": report})

    def _push(self, message: dict[str, KvEventBatch | LoadReport | int | str]) -> None:
        self._pushes.append(orjson.dumps(message, default=_dump))
        self._wake.set()

    async def _pump(self, request: GenerateRequest, trace: dict[str, str] | None) -> None:
        rid = request.request_id
        self._activity.begin()
        try:
            with self._span(SPAN_NAME, trace, **{"dgw.request_id": rid}):
                async with aclosing(self._engine.generate(request)) as events:  # type: ignore[type-var]
                    async for event in events:
                        self._emit(rid, event)
        except Exception as exc:  # an engine bug: this request ends with an error, the others carry on
            log.exception("request %s failed in the engine", rid)
            self._emit(rid, finish_event(FinishReason.ERROR, error_kind=ErrorKind.ENGINE, message=str(exc)[:300]))
        finally:
            del self._pumps[rid]
            self._activity.end()

    def _emit(self, request_id: str, event: dict[str, Any]) -> None:
        self._outbox.append((request_id, event))
        self._wake.set()

    async def _write(self) -> None:
        """Send what the pumps emitted, one message per wake-up (an engine step)."""
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                batch, self._outbox = self._outbox, []
                pushes, self._pushes = self._pushes, []
                if batch:
                    await self._ws.send_bytes(orjson.dumps(batch))
                for message in pushes:
                    await self._ws.send_bytes(message)
        except (WebSocketDisconnect, RuntimeError, OSError) as exc:
            # The gateway went away; the reader sees the disconnect and the pumps are cancelled.
            log.debug("mux connection closed while sending: %s", exc)


def _dump(value: Any) -> Any:
    """orjson's fallback for the pushes' pydantic models (the wire's field names)."""
    if isinstance(value, (KvEventBatch, LoadReport)):
        return value.model_dump(mode="json", by_alias=True)
    raise TypeError(f"{type(value).__name__} is not a push payload")


def _no_span(*_: Any, **__: Any) -> AbstractContextManager[None]:
    return nullcontext()


def _request_id(raw: Any) -> str | None:
    """The request id an invalid op names, if any (its error goes back to that request)."""
    if not isinstance(raw, dict):
        return None
    request = raw.get("request")
    rid = request.get("request_id") if isinstance(request, dict) else raw.get("request_id")
    return rid if isinstance(rid, str) and 0 < len(rid) <= 256 else None
