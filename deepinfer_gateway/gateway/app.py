"""The gateway's FastAPI application factory (no module-level app, no singletons).

`create_app(settings)` builds everything in the lifespan: the worker client, the
registry with its health checks, the routing policy and the request path. Tests
build their own app from their own settings.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse, Response

from deepinfer_gateway import protocol as wp
from deepinfer_gateway.config import ApiKey, GatewaySettings, WorkerSpec
from deepinfer_gateway.gateway.auth import KeyStore, presented_key
from deepinfer_gateway.errors import (
    BridgeError,
    ClientGone,
    Forbidden,
    GatewayError,
    InternalError,
    PayloadTooLarge,
    RateLimited,
    Unauthorized,
)
from deepinfer_gateway.gateway.error_json import client_protocol, error_response
from deepinfer_gateway.gateway.metrics import GatewayMetrics
from deepinfer_gateway.gateway.ratelimit import MemoryRateLimiter, RedisRateLimiter
from deepinfer_gateway.gateway.registry import WorkerRegistry
from deepinfer_gateway.gateway.serving import RequestServer
from deepinfer_gateway.gateway.worker_client import Timeouts, WorkerClient
from deepinfer_gateway.recipe_bridge.encoder import PromptEncoder
from deepinfer_gateway.recipe_bridge.prepare import ApiProtocol, BridgeConfig, PreparedRequest, RequestPreparer
from deepinfer_gateway.recipe_bridge.tokenizer import load_tokenizer
from deepinfer_gateway.kvcache.events import KvEventFeeder
from deepinfer_gateway.kvcache.factory import create_prefix_index
from deepinfer_gateway.redis_conn import redis_client
from deepinfer_gateway.router.inflight import MemoryInflight, RedisInflight
from deepinfer_gateway.router.planner import RoutePlanner

log = logging.getLogger(__name__)


class RoutingUpdate(BaseModel):
    """Body of `PUT /admin/routing`: the policies to switch to (omitted ones stay), each a
    name or a table with parameters; the planner validates them."""

    model_config = ConfigDict(extra="forbid")
    policy: str | dict[str, Any] | None = None
    decode_policy: str | dict[str, Any] | None = None


@dataclass
class GatewayState:
    settings: GatewaySettings
    metrics: GatewayMetrics
    preparer: RequestPreparer
    registry: WorkerRegistry
    server: RequestServer
    keys: KeyStore
    limiter: MemoryRateLimiter | RedisRateLimiter
    feeder: KvEventFeeder
    started_at: int


async def _admit(state: GatewayState, key: ApiKey, prepared: PreparedRequest
                 ) -> tuple[dict[str, str], Callable[[int], None] | None]:
    """Rate limits: (x-ratelimit headers, a callback debiting output tokens at the end), or 429."""
    limits = (key.requests_per_minute, key.tokens_per_minute)
    if limits == (None, None):
        return {}, None
    verdict = await state.limiter.admit(key.name, limits, prepared.prompt_tokens)
    headers = verdict.headers()
    if not verdict.allowed:
        raise RateLimited(f"Rate limit reached for API key {key.name}; retry after {headers['retry-after']}s.",
                          headers=headers)
    limiter = state.limiter

    def debit(tokens: int) -> None:
        asyncio.get_running_loop().create_task(limiter.debit(key.name, tokens))

    return headers, debit


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"Request body of {declared} bytes exceeds the limit of {limit} bytes.")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"Request body exceeds the limit of {limit} bytes.")
        chunks.append(chunk)
    return b"".join(chunks)


SESSION_HEADER = "x-session-id"
# dgw_requests_total `protocol` labels of the routes that are not a generation protocol.
MODELS = "models"
COUNT_TOKENS = "count_tokens"


async def _unless_disconnected(request: Request, serving: Awaitable[Response]) -> Response:
    """Await `serving` (routing + waiting for the first token), but cancel it if the client
    leaves first, so a long prefill for a client that is gone is aborted on the worker.
    Streaming responses watch for disconnects themselves once they start."""
    task = asyncio.ensure_future(serving)
    watcher = asyncio.ensure_future(request.receive())  # the body is read: the next message is a disconnect
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            # It may have finished before the cancel landed: then its response holds a worker
            # stream; returning it lets the response run, see the disconnect and release it.
            return await task
        raise ClientGone()
    finally:
        watcher.cancel()


class GatewayApp(FastAPI):
    """FastAPI, except that the generation routes (`hot`: path -> endpoint) skip its
    middleware, routing and dependency machinery: ~15% of the gateway's CPU per short
    request went there (bench/gateway_capacity.py --profile). The routes stay registered
    (OpenAPI, and any request the fast path does not take goes through FastAPI).
    What that stack did for them is done here: `scope["app"]`, and a 500 in the protocol's
    error JSON for an unexpected exception (re-raised, so the server logs it); the endpoints
    catch, count and render their own errors, so that is a backstop."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.hot: dict[str, Callable[[Request], Awaitable[Response]]] = {}

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and not scope.get("root_path"):
            endpoint = self.hot.get(scope["path"])
            if endpoint is not None:
                scope["app"] = self
                request = Request(scope, receive)
                try:
                    response = await endpoint(request)
                except Exception:
                    protocol = client_protocol(scope["path"], request.headers)
                    await error_response(protocol, InternalError())(scope, receive, send)
                    raise
                await response(scope, receive, send)
                return
        await super().__call__(scope, receive, send)


def create_app(settings: GatewaySettings, metrics: GatewayMetrics | None = None, *,
               shutting_down: threading.Event | None = None) -> GatewayApp:
    """`shutting_down`: set by the host when a stop signal arrives (asgi.serve_until_signal's
    on_signal); from then on `/ready` answers 503 while requests in flight carry on."""
    metrics = metrics or GatewayMetrics()
    bundle = load_tokenizer(settings.tokenizer_path)
    preparer = RequestPreparer(
        PromptEncoder(bundle),
        BridgeConfig(model_names=settings.model_names, model_aliases=settings.model_aliases,
                     context_limit=settings.context_limit, images=settings.images),
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        client = WorkerClient(Timeouts(connect_s=settings.connect_timeout_s,
                                       first_event_s=settings.first_event_timeout_s,
                                       between_events_s=settings.between_events_timeout_s))
        await client.start()
        redis = None
        if settings.redis_url:
            redis = redis_client(settings.redis_url, cluster=settings.redis_cluster)
        keys = KeyStore(settings.api_keys, redis if settings.api_keys_in_redis else None)
        limiter = (RedisRateLimiter(redis, on_error=metrics.redis_errors.labels("ratelimit").inc) if redis
                   else MemoryRateLimiter())
        index = create_prefix_index(settings.redis_url, redis_cluster=settings.redis_cluster,
                                    registry=metrics.registry, writer_lease_s=settings.kv_writer_lease_s)
        feeder = KvEventFeeder(index, client.session, interval_s=settings.router.kv_events_interval_s)
        inflight = (RedisInflight(redis, settings.router.inflight_lease_s, metrics.redis_errors.labels("inflight").inc)
                    if redis else MemoryInflight())
        registry = WorkerRegistry(settings.workers, client, settings.health, metrics)
        for worker in registry.workers.values():
            feeder.add_worker(worker.worker_id, worker.url)
        await registry.start()
        server = RequestServer(registry, client, RoutePlanner(settings.router), index, inflight, bundle, metrics,
                               settings)
        app.state.gateway = GatewayState(settings, metrics, preparer, registry, server, keys, limiter, feeder,
                                         int(time.time()))
        try:
            yield
        finally:
            await registry.stop()
            await feeder.aclose()
            await index.aclose()
            await client.close()
            if redis is not None:
                await redis.aclose()

    app = GatewayApp(title="DeepInfer Gateway", version="0.1.0", lifespan=lifespan)
    app.state.shutting_down = shutting_down or threading.Event()

    def count(label: str, model: str, status: int) -> None:
        """dgw_requests_total; `label` is the protocol (or `models`, `count_tokens`)."""
        if model not in settings.model_names:
            model = "unknown"  # bounded label: never a client-chosen string
        metrics.requests.labels(label, model, str(status)).inc()

    def refuse(label: str, protocol: ApiProtocol | None, model: str, error: GatewayError,
               request_id: str | None = None) -> Response:
        count(label, model, error.status_code)
        response = error_response(protocol, error)
        if request_id is not None:
            response.headers[wp.REQUEST_ID_HEADER] = request_id
        return response

    def caught(exc: Exception, request_id: str) -> GatewayError:
        """The GatewayError an endpoint answers for an exception it caught."""
        if isinstance(exc, (ClientGone, ClientDisconnect)):  # gone while we read its body or awaited a token
            metrics.client_disconnects.inc()
            return ClientGone()
        if isinstance(exc, GatewayError):
            return exc
        log.error("request %s failed unexpectedly", request_id, exc_info=exc)
        return InternalError()

    async def authenticate(request: Request) -> ApiKey:
        key = await request.app.state.gateway.keys.lookup(presented_key(request.headers))
        if key is None:
            raise Unauthorized("Missing or invalid API key.")
        return key

    def may_use(key: ApiKey, served: str, requested: str) -> bool:
        """A key's allow-list admits a served name and every alias of it, or an alias by its own name."""
        return key.allows(served) or key.allows(requested)

    async def handle(request: Request, protocol: ApiProtocol) -> Response:
        arrival = time.perf_counter()
        state: GatewayState = request.app.state.gateway
        request_id = request.headers.get(wp.REQUEST_ID_HEADER) or uuid.uuid4().hex
        model = "unknown"
        try:
            key = await authenticate(request)
            body = await _read_body(request, settings.max_body_bytes)
            prepared = await preparer.prepare_async(protocol, body)
            model = prepared.model
            metrics.preprocess.observe(time.perf_counter() - arrival)
            if not may_use(key, model, prepared.requested_model):
                raise Forbidden(f"This API key may not use model {prepared.requested_model}.")
            headers, on_done = await _admit(state, key, prepared)
            serving = state.server.serve(prepared, request_id, arrival, workload_class=key.workload_class,
                                         headers=headers, on_done=on_done,
                                         session_key=request.headers.get(SESSION_HEADER))
            return await _unless_disconnected(request, serving)
        except Exception as exc:
            if isinstance(exc, BridgeError) and exc.model:
                model = exc.model
            return refuse(str(protocol), protocol, model, caught(exc, request_id), request_id)

    async def count_tokens(request: Request) -> Response:
        """Anthropic's `POST /v1/messages/count_tokens`: the Messages body's prompt tokens."""
        request_id = request.headers.get(wp.REQUEST_ID_HEADER) or uuid.uuid4().hex
        model = "unknown"
        try:
            key = await authenticate(request)
            body = await _read_body(request, settings.max_body_bytes)
            counted = await preparer.count_tokens_async(body)
            model = counted.model
            if not may_use(key, model, counted.requested_model):
                raise Forbidden(f"This API key may not use model {counted.requested_model}.")
        except Exception as exc:
            if isinstance(exc, BridgeError) and exc.model:
                model = exc.model
            return refuse(COUNT_TOKENS, ApiProtocol.MESSAGES, model, caught(exc, request_id), request_id)
        count(COUNT_TOKENS, model, 200)
        return JSONResponse({"input_tokens": counted.input_tokens}, headers={wp.REQUEST_ID_HEADER: request_id})

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await handle(request, ApiProtocol.CHAT)

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        return await handle(request, ApiProtocol.RESPONSES)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle(request, ApiProtocol.COMPLETIONS)

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        return await handle(request, ApiProtocol.MESSAGES)

    app.post("/v1/messages/count_tokens")(count_tokens)

    app.hot = {"/v1/chat/completions": chat_completions, "/v1/responses": responses,
               "/v1/completions": completions, "/v1/messages": messages, "/v1/messages/count_tokens": count_tokens}

    def model_card(name: str, served: str, created: int, protocol: ApiProtocol | None) -> dict[str, Any]:
        """vLLM's model object (`max_model_len`: the context limit; aliases name their served
        model in `root`/`parent`), or Anthropic's for the Anthropic SDK."""
        if protocol is ApiProtocol.MESSAGES:
            created_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(created))
            return {"type": "model", "id": name, "display_name": name, "created_at": created_at}
        return {"id": name, "object": "model", "created": created, "owned_by": "deepseek", "root": served,
                "parent": None if name == served else served, "max_model_len": settings.context_limit}

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        """The names the caller's key may use: served names, then aliases."""
        protocol = client_protocol(request.url.path, request.headers)
        try:
            key = await authenticate(request)
        except GatewayError as exc:
            return refuse(MODELS, protocol, "unknown", exc)
        created = request.app.state.gateway.started_at
        data = [model_card(name, served, created, protocol)
                for name, served in preparer.catalog.visible(key.allows)]
        count(MODELS, "unknown", 200)
        if protocol is ApiProtocol.MESSAGES:
            return JSONResponse({"data": data, "has_more": False, "first_id": data[0]["id"] if data else None,
                                 "last_id": data[-1]["id"] if data else None})
        return JSONResponse({"object": "list", "data": data})

    @app.get("/v1/models/{model_id:path}")
    async def model_info(model_id: str, request: Request) -> Response:
        protocol = client_protocol(request.url.path, request.headers)
        target = preparer.catalog.resolve(model_id)
        try:
            key = await authenticate(request)
            if target is None or not may_use(key, target.served, model_id):
                raise BridgeError.model_not_found(model_id)
        except GatewayError as exc:
            return refuse(MODELS, protocol, target.served if target else "unknown", exc)
        count(MODELS, target.served, 200)
        return JSONResponse(model_card(model_id, target.served, request.app.state.gateway.started_at, protocol))

    async def require_admin(request: Request) -> None:
        key = await request.app.state.gateway.keys.lookup(presented_key(request.headers))
        if key is None:
            raise Unauthorized("Missing or invalid API key.")
        if not key.admin and settings.admin_keys_required:
            raise Forbidden("This endpoint needs an API key with admin rights.")

    @app.get("/admin/workers")
    async def list_workers(request: Request) -> Response:
        await require_admin(request)
        state: GatewayState = request.app.state.gateway
        return JSONResponse({"workers": [
            {"id": w.worker_id, "url": w.url, "role": str(w.spec.role), "hardware": str(w.spec.hardware),
             "pool": w.pool, "kv_format": w.kv_format, "healthy": w.healthy, "inflight": w.inflight,
             "consecutive_failures": w.consecutive_failures, "kv_events_cursor": state.feeder.cursor(w.worker_id),
             "load": w.load.model_dump(mode="json") if w.load else None}
            for w in state.registry.workers.values()]})

    @app.post("/admin/workers")
    async def add_worker(request: Request) -> Response:
        await require_admin(request)
        state: GatewayState = request.app.state.gateway
        try:
            spec = WorkerSpec.model_validate_json(await request.body())
        except ValueError as exc:
            raise GatewayError(f"Invalid worker: {exc}", status_code=400) from None
        worker = state.registry.add(spec)
        state.feeder.add_worker(worker.worker_id, worker.url)
        await state.registry.check_all()
        return JSONResponse({"id": worker.worker_id, "healthy": worker.healthy}, status_code=201)

    @app.delete("/admin/workers/{worker_id:path}")
    async def remove_worker(worker_id: str, request: Request) -> Response:
        await require_admin(request)
        state: GatewayState = request.app.state.gateway
        if not state.registry.remove(worker_id):
            raise GatewayError(f"No worker {worker_id}.", status_code=404)
        await state.feeder.remove_worker(worker_id)
        return JSONResponse({"id": worker_id, "removed": True})

    @app.get("/admin/index")
    async def index_stats(request: Request) -> Response:
        await require_admin(request)
        return JSONResponse(await request.app.state.gateway.server.index.stats())

    @app.get("/admin/routing")
    async def get_routing(request: Request) -> Response:
        await require_admin(request)
        return JSONResponse(request.app.state.gateway.server.planner.describe())

    @app.put("/admin/routing")
    async def set_routing(request: Request) -> Response:
        """Switch this replica's routing policies (each replica has its own: send it to all)."""
        await require_admin(request)
        planner: RoutePlanner = request.app.state.gateway.server.planner
        try:
            update = RoutingUpdate.model_validate_json(await request.body())
            planner.reconfigure(update.policy, update.decode_policy)
        except ValueError as exc:
            raise GatewayError(f"Invalid routing update: {exc}", status_code=400) from None
        log.info("routing policies set: policy=%s decode_policy=%s", planner.settings.policy,
                 planner.settings.decode_policy)
        return JSONResponse(planner.describe())

    @app.exception_handler(GatewayError)
    async def gateway_error(request: Request, exc: GatewayError) -> Response:
        return error_response(None, exc)

    @app.get("/health")
    async def health() -> Response:
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready(request: Request) -> Response:
        healthy = len(request.app.state.gateway.registry.healthy())
        if request.app.state.shutting_down.is_set():
            return JSONResponse({"status": "shutting_down", "healthy_workers": healthy}, status_code=503)
        status = 200 if healthy else 503
        return JSONResponse({"status": "ready" if healthy else "no healthy worker", "healthy_workers": healthy},
                            status_code=status)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        protocol = client_protocol(request.url.path, request.headers)
        return error_response(protocol, GatewayError(str(exc.detail), status_code=exc.status_code))

    @app.exception_handler(Exception)
    async def unexpected_error(request: Request, exc: Exception) -> Response:
        """Routes outside the fast path; Starlette re-raises after this response, so the server logs it."""
        count(MODELS if request.url.path.startswith("/v1/models") else "other", "unknown", 500)
        return error_response(client_protocol(request.url.path, request.headers), InternalError())

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        return error_response(None, GatewayError(str(exc.errors()), status_code=400))

    return app
