"""The gateway's composition root: the FastAPI application factory (no module-level app,
no singletons).

`create_app(settings)` loads the tokenizer, then builds everything else in the lifespan:
the routing core it shares with the EPP (routing_core.py: the worker client, Redis, the
prefix index and its KV event feeder, in-flight counts, the registry with its health
checks, admin sync, discovery), API keys, rate limiter, stored Responses, and the request
path (serving/server.py RequestServer). It mounts the client routes (routes.py), the admin API
(admin.py), /health, /ready and /metrics, and the error handlers. Tests build their own
app from their own settings.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import TypeAdapter
from redis import asyncio as aioredis
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Match

from deepinfer_gateway.config import GatewaySettings, WorkerSpec
from deepinfer_gateway.config.models import ConversationsSettings, ResponsesSettings
from deepinfer_gateway.core.errors import GatewayError, InternalError
from deepinfer_gateway.gateway.http.admin import RoutingUpdate, admin_router
from deepinfer_gateway.gateway.http.openapi_doc import REF, document
from deepinfer_gateway.gateway.http.routes import MODELS, ClientRoutes, Endpoint
from deepinfer_gateway.gateway.routing_core import RoutingCore
from deepinfer_gateway.gateway.serving.auth import KeyStore
from deepinfer_gateway.gateway.serving.background_store import (
    BackgroundStore,
    MemoryBackgroundStore,
    RedisBackgroundStore,
)
from deepinfer_gateway.gateway.serving.conversation_store import (
    ConversationQuota,
    ConversationStore,
    MemoryConversationStore,
    RedisConversationStore,
)
from deepinfer_gateway.gateway.serving.conversations_api import ConversationsState
from deepinfer_gateway.gateway.serving.error_json import client_protocol, error_response
from deepinfer_gateway.gateway.serving.ratelimit import MemoryRateLimiter, RedisRateLimiter
from deepinfer_gateway.gateway.serving.response_store import (
    MemoryResponseStore,
    Quota,
    RedisResponseStore,
    ResponseStore,
)
from deepinfer_gateway.gateway.serving.responses_api import ResponsesState
from deepinfer_gateway.gateway.serving.server import RequestServer
from deepinfer_gateway.gateway.state import GatewayState
from deepinfer_gateway.gateway.telemetry.metrics import GatewayMetrics
from deepinfer_gateway.gateway.telemetry.metrics_listener import MetricsListener
from deepinfer_gateway.recipe_bridge.encoder import PromptEncoder
from deepinfer_gateway.recipe_bridge.prepare import BridgeConfig, RequestPreparer
from deepinfer_gateway.recipe_bridge.prepared import ApiProtocol
from deepinfer_gateway.recipe_bridge.tokenizer import load_tokenizer

log = logging.getLogger(__name__)


class GatewayApp(FastAPI):
    """FastAPI, except that the fast routes (`fast_routes`: POST path -> endpoint) skip its
    middleware, routing and dependency machinery: ~15% of the gateway's CPU per short
    request went there (bench/gateway_capacity.py --profile). `add_fast_route` also
    registers each with FastAPI (OpenAPI, and any request the fast path does not take).
    What that stack did for them is done here: `scope["app"]`, and a 500 in the protocol's
    error JSON for an unexpected exception (re-raised, so the server logs it); the endpoints
    catch, count and render their own errors, so that is a backstop."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fast_routes: dict[str, Endpoint] = {}

    def add_fast_route(self, path: str, endpoint: Endpoint) -> None:
        self.add_api_route(path, endpoint, methods=["POST"])
        self.fast_routes[path] = endpoint

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and not scope.get("root_path"):
            endpoint = self.fast_routes.get(scope["path"])
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


def response_store(settings: ResponsesSettings, redis: aioredis.Redis | None) -> ResponseStore | None:
    """Where stored Responses live: Redis when the gateway has one (shared by its replicas, durable), else memory."""
    if not settings.store:
        return None
    quota = Quota(settings.ttl_s, settings.max_per_key, settings.max_bytes, settings.max_bytes_per_key,
                  settings.max_total_bytes)
    if redis is not None:
        return RedisResponseStore(redis, quota)
    return MemoryResponseStore(quota)


def allowed_methods(app: FastAPI, request: Request) -> list[str]:
    """Every method some route serves on the request's path (the routes of one path are one per method)."""
    methods: set[str] = set()
    for route in app.router.routes:
        if isinstance(route, APIRoute) and route.matches(request.scope)[0] is not Match.NONE:
            methods |= route.methods or set()
    return sorted(methods)


def background_store(responses: ResponseStore | None) -> BackgroundStore | None:
    """Background responses' run state, beside the stored responses (background_store.py)."""
    if isinstance(responses, RedisResponseStore):
        return RedisBackgroundStore(responses)
    if isinstance(responses, MemoryResponseStore):
        return MemoryBackgroundStore(responses)
    return None


def conversation_store(settings: ConversationsSettings, redis: aioredis.Redis | None) -> ConversationStore | None:
    """Where conversations live: Redis when the gateway has one (shared by its replicas, durable), else memory."""
    if not settings.enabled:
        return None
    quota = ConversationQuota(settings.max_per_key, settings.max_items, settings.max_bytes_per_key,
                              settings.max_total_bytes)
    return RedisConversationStore(redis, quota) if redis is not None else MemoryConversationStore(quota)


def create_app(settings: GatewaySettings, metrics: GatewayMetrics | None = None, *,
               shutting_down: threading.Event | None = None) -> GatewayApp:
    """`shutting_down`: set by the host when a stop signal arrives (asgi.serve_until_signal's
    on_signal); from then on `/ready` answers 503 while requests in flight carry on."""
    metrics = metrics or GatewayMetrics()
    metrics.expect_models([str(p) for p in ApiProtocol], settings.model_names)
    bundle = load_tokenizer(settings.tokenizer_path)
    preparer = RequestPreparer(
        PromptEncoder(bundle),
        BridgeConfig(model_names=settings.model_names, model_aliases=settings.model_aliases,
                     context_limit=settings.context_limit, images=settings.images),
    )
    preparer.warm_up()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        core = RoutingCore(settings, bundle, metrics)
        await core.start()
        redis = core.redis
        keys = KeyStore(settings.api_keys, redis if settings.api_keys_in_redis else None,
                        on_error=metrics.redis_errors.labels("apikeys").inc)
        limiter = (RedisRateLimiter(redis, on_error=metrics.redis_errors.labels("ratelimit").inc) if redis
                   else MemoryRateLimiter())
        server = RequestServer(core.registry, core.planner, core.index, core.inflight, bundle, metrics, settings,
                               core.affinity, redis)
        conversations = ConversationsState(conversation_store(settings.conversations, redis),
                                           on_error=metrics.redis_errors.labels("conversations").inc)
        stored = response_store(settings.responses, redis)
        responses = ResponsesState(stored, on_error=metrics.redis_errors.labels("responses").inc,
                                   on_not_stored=lambda reason: metrics.responses_not_stored.labels(reason).inc(),
                                   conversations=conversations,
                                   on_not_appended=metrics.conversation_appends_failed.inc,
                                   background=background_store(stored),
                                   on_background_end=lambda outcome: metrics.background_responses.labels(outcome).inc())
        app.state.gateway = GatewayState(core.registry, server, keys, limiter, core.feeder, int(time.time()),
                                         core.admin, responses, conversations)
        listener = None
        if settings.metrics_port is not None:
            listener = MetricsListener(settings.host, settings.metrics_port, metrics.exposition)
            listener.start()
        try:
            yield
        finally:
            if responses.background is not None:
                await responses.background.stop()  # its runs end failed, their engine requests aborted
            if listener is not None:
                await asyncio.to_thread(listener.stop)
            if server.gate is not None:
                await server.gate.close()
            if server.sessions is not None:
                await server.sessions.close()
            await core.stop()

    docs: dict[str, Any] = {} if settings.api_docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = GatewayApp(title="DeepInfer Gateway", version="0.1.0", lifespan=lifespan, **docs)
    app.state.shutting_down = shutting_down or threading.Event()

    client_routes = ClientRoutes(settings, metrics, preparer)
    for path, endpoint in client_routes.fast_routes().items():
        app.add_fast_route(path, endpoint)
    app.add_api_route("/v1/models", client_routes.models, methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", client_routes.model_info, methods=["GET"])
    client_routes.add_stored_responses(app)
    client_routes.add_conversations(app)
    app.include_router(admin_router(settings))

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

    if settings.metrics_port is None:  # else on its own port (lifespan), not shown to API callers
        @app.get("/metrics")
        async def prometheus_metrics() -> Response:
            return Response(generate_latest(metrics.exposition), media_type=CONTENT_TYPE_LATEST)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            admin_bodies = {("/admin/workers", "post"): TypeAdapter(WorkerSpec).json_schema(ref_template=REF),
                            ("/admin/routing", "put"): RoutingUpdate.model_json_schema(ref_template=REF)}
            models = tuple(name for name, _ in preparer.catalog.visible(lambda _: True))
            app.openapi_schema = document(FastAPI.openapi(app), admin_bodies, models)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

    @app.exception_handler(GatewayError)
    async def gateway_error(request: Request, exc: GatewayError) -> Response:
        return error_response(None, exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        protocol = client_protocol(request.url.path, request.headers)
        # exc.headers: a 405's Allow (RFC 9110), a 401's WWW-Authenticate.
        headers = dict(exc.headers or {})
        if exc.status_code == 405:  # Starlette names the methods of the first route on the path only
            headers = {k: v for k, v in headers.items() if k.lower() != "allow"}
            headers["allow"] = ", ".join(allowed_methods(app, request))
        return error_response(protocol, GatewayError(str(exc.detail), status_code=exc.status_code,
                                                     headers=headers))

    @app.exception_handler(Exception)
    async def unexpected_error(request: Request, exc: Exception) -> Response:
        """Routes outside the fast path; Starlette re-raises after this response, so the server logs it."""
        client_routes.count(MODELS if request.url.path.startswith("/v1/models") else "other", "unknown", 500)
        return error_response(client_protocol(request.url.path, request.headers), InternalError())

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        return error_response(None, GatewayError(str(exc.errors()), status_code=400))

    return app
