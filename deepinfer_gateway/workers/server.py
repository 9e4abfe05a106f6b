"""The worker HTTP server: any `Engine` exposed over worker protocol v1, and v2's
multiplexed connection (workers/mux.py).

`create_worker_app(engine)` builds the app; its lifespan starts and stops the engine.
The generate reply is NDJSON (`protocol.encode_line` per event). A client that
disconnects mid-stream cancels the response task (Starlette listens for
`http.disconnect`), which closes the engine's iterator, which aborts the request:
scope-bound, no bookkeeping by hand. Bad bodies get 400 (not JSON) or 422 (not a
valid request) with an error JSON, never a 500.

`kv_events` long-polls when asked (`wait_ms`): the handler waits on the engine's event
log (`Engine.wait_kv_events`) raced against the client's `http.disconnect`, so a gateway
that goes away mid-wait ends the wait at once and leaves no task behind. uvicorn has no
request timeout, so only `wait_ms` (at most MAX_KV_EVENTS_WAIT_MS) bounds the reply;
keep-alive only counts between requests, so a long poll does not age its connection.

Optional extra routers (the OpenAI/SGLang compatibility layer, workers/sim/compat.py)
are mounted beside the protocol endpoints.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import orjson
from fastapi import APIRouter, FastAPI, Request, WebSocket
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from deepinfer_gateway.core.protocol import (
    ABORT_PATH,
    GENERATE_PATH,
    HEALTH_PATH,
    INFO_PATH,
    KV_EVENTS_PATH,
    LOAD_PATH,
    MAX_KV_EVENTS_WAIT_MS,
    MUX_PATH,
    NDJSON,
    AbortRequest,
    ErrorKind,
    GenerateRequest,
    encode_line,
)
from deepinfer_gateway.core.worker_auth import RequireWorkerToken, SecretTokens, presents_token
from deepinfer_gateway.workers.engine import Engine
from deepinfer_gateway.workers.mux import MuxSession
from deepinfer_gateway.workers.pushes import Activity

JSON = "application/json"
# Longest KV events long poll a worker grants: a wait pins one connection and one task,
# and delays the worker's graceful shutdown by up to this much.


class KvEventsQuery(BaseModel):
    """`GET kv_events` query: cursor, page size, and how long to wait for events."""

    model_config = ConfigDict(extra="ignore")

    after: int = Field(0, ge=0)
    limit: int = Field(10_000, ge=1, le=100_000)
    wait_ms: int = Field(0, ge=0, le=MAX_KV_EVENTS_WAIT_MS)


def json_response(payload: Any, status_code: int = 200) -> Response:
    if isinstance(payload, BaseModel):
        payload = payload.model_dump(mode="json", by_alias=True)
    return Response(orjson.dumps(payload), status_code=status_code, media_type=JSON)


def error_response(err: ValidationError, message: str = "invalid request body", status_code: int | None = None
                   ) -> Response:
    not_json = any(e["type"] == "json_invalid" for e in err.errors())
    details = err.errors(include_url=False, include_context=False, include_input=False)
    body = {"error": {"kind": str(ErrorKind.INVALID_REQUEST), "message": message, "details": details}}
    return json_response(body, status_code or (400 if not_json else 422))


async def _disconnected(request: Request) -> None:
    """Return when the client goes away (the request body, if any, is discarded)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def wait_unless_disconnected(request: Request, wait: Awaitable[None]) -> bool:
    """Await `wait` unless the client disconnects first; True when it did. Both sides are
    tasks that are cancelled and awaited before returning, whichever way it ends."""
    waiting = asyncio.ensure_future(wait)
    watching = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((waiting, watching), return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiting.cancel()
        watching.cancel()
        await asyncio.gather(waiting, watching, return_exceptions=True)
    if not waiting.cancelled() and (error := waiting.exception()) is not None:
        raise error  # a failing engine wait is a bug: surface it, do not answer as if it timed out
    return watching.done() and not watching.cancelled()


async def ndjson_stream(events: AsyncIterator[dict[str, Any]], activity: Activity | None = None
                        ) -> AsyncIterator[bytes]:
    """`activity`: counts the reply as an open request while it streams (workers/pushes.py)."""
    if activity is not None:
        activity.begin()
    try:
        async for event in events:
            yield encode_line(event)
    finally:
        if activity is not None:
            activity.end()
        close = getattr(events, "aclose", None)
        if close is not None:
            await close()  # runs the engine's finally: abort when unfinished


def protocol_router(engine: Engine, tokens: SecretTokens | None = None) -> APIRouter:
    """v1's endpoints and v2's connection (workers/mux.py); `tokens`: v2 re-checks the
    connection's token at every new request (the handshake itself is checked by
    RequireWorkerToken)."""
    router = APIRouter()
    activity = Activity()  # open requests on every path: wakes the v2 load pushers

    @router.websocket(MUX_PATH)
    async def mux(websocket: WebSocket) -> None:
        headers = websocket.scope["headers"]
        authorized = None if tokens is None else (lambda: presents_token(tokens, headers))
        await MuxSession(engine, websocket, authorized, activity).run()

    @router.post(GENERATE_PATH)
    async def generate(request: Request) -> Response:
        try:
            body = GenerateRequest.model_validate_json(await request.body())
        except ValidationError as err:
            return error_response(err)
        return StreamingResponse(ndjson_stream(engine.generate(body), activity), media_type=NDJSON)

    @router.post(ABORT_PATH)
    async def abort(request: Request) -> Response:
        try:
            body = AbortRequest.model_validate_json(await request.body())
        except ValidationError as err:
            return error_response(err)
        return json_response({"aborted": await engine.abort(body.request_id)})

    @router.get(LOAD_PATH)
    async def load() -> Response:
        return json_response(engine.load())

    @router.get(KV_EVENTS_PATH)
    async def kv_events(request: Request) -> Response:
        try:
            query = KvEventsQuery.model_validate(dict(request.query_params))
        except ValidationError as err:
            return error_response(err, "invalid kv_events query", 400)
        if query.wait_ms and await wait_unless_disconnected(
                request, engine.wait_kv_events(query.after, query.wait_ms / 1000)):
            return Response(status_code=204)  # nobody reads it
        return json_response(engine.kv_events(query.after, query.limit))

    @router.get(INFO_PATH)
    async def info() -> Response:
        return json_response(engine.info)

    @router.get(HEALTH_PATH)
    async def health() -> Response:
        if not getattr(engine, "healthy", True):  # e.g. DeepInfer's step loop died
            return json_response({"status": "unhealthy", "epoch": engine.info.epoch}, status_code=503)
        return json_response({"status": "ok", "epoch": engine.info.epoch})

    return router


def create_worker_app(engine: Engine, extra_routers: Sequence[APIRouter] = (),
                      tokens: SecretTokens | None = None) -> FastAPI:
    """With `tokens`, every endpoint but /health needs one of them (worker_auth.py): a call
    without gets 401 before it reaches the engine."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await engine.start()
        try:
            yield
        finally:
            await engine.stop()

    app = FastAPI(title=f"DeepInfer worker {engine.info.worker_id}", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.include_router(protocol_router(engine, tokens))
    for router in extra_routers:
        app.include_router(router)
    if tokens is not None:
        app.add_middleware(RequireWorkerToken, tokens=tokens)
    return app
