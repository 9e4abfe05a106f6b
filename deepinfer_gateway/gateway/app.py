"""The gateway's FastAPI application factory (no module-level app, no singletons).

`create_app(settings)` builds everything in the lifespan: the worker client, the
registry with its health checks, the routing policy and the request path. Tests
build their own app from their own settings.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response

from deepinfer_gateway import protocol as wp
from deepinfer_gateway.config import GatewaySettings
from deepinfer_gateway.gateway.errors import GatewayError, error_response
from deepinfer_gateway.gateway.metrics import GatewayMetrics
from deepinfer_gateway.gateway.registry import WorkerRegistry
from deepinfer_gateway.gateway.serving import RequestServer
from deepinfer_gateway.gateway.worker_client import Timeouts, WorkerClient
from deepinfer_gateway.recipe_bridge.encoder import PromptEncoder
from deepinfer_gateway.recipe_bridge.prepare import ApiProtocol, BridgeConfig, BridgeError, RequestPreparer
from deepinfer_gateway.recipe_bridge.tokenizer import load_tokenizer
from deepinfer_gateway.router.policies import make_policy

log = logging.getLogger(__name__)


@dataclass
class GatewayState:
    settings: GatewaySettings
    metrics: GatewayMetrics
    preparer: RequestPreparer
    registry: WorkerRegistry
    server: RequestServer
    started_at: int


class PayloadTooLarge(GatewayError):
    status_code = 413


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


def create_app(settings: GatewaySettings, metrics: GatewayMetrics | None = None) -> FastAPI:
    metrics = metrics or GatewayMetrics()
    bundle = load_tokenizer(settings.tokenizer_path)
    preparer = RequestPreparer(
        PromptEncoder(bundle),
        BridgeConfig(model_names=settings.model_names, context_limit=settings.context_limit),
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        client = WorkerClient(Timeouts(connect_s=settings.connect_timeout_s,
                                       first_event_s=settings.first_event_timeout_s,
                                       between_events_s=settings.between_events_timeout_s))
        await client.start()
        registry = WorkerRegistry(settings.workers, client, settings.health, metrics)
        await registry.start()
        server = RequestServer(registry, client, make_policy("round_robin"), bundle, metrics,
                               settings.max_attempts)
        app.state.gateway = GatewayState(settings, metrics, preparer, registry, server, int(time.time()))
        try:
            yield
        finally:
            await registry.stop()
            await client.close()

    app = FastAPI(title="DeepInfer Gateway", version="0.1.0", lifespan=lifespan)

    async def handle(request: Request, protocol: ApiProtocol) -> Response:
        arrival = time.perf_counter()
        state: GatewayState = request.app.state.gateway
        request_id = request.headers.get(wp.REQUEST_ID_HEADER) or uuid.uuid4().hex
        model = "unknown"
        try:
            body = await _read_body(request, settings.max_body_bytes)
            prepared = preparer.prepare(protocol, body)
            model = prepared.model
            metrics.preprocess.observe(time.perf_counter() - arrival)
            return await state.server.serve(prepared, request_id, arrival)
        except BridgeError as exc:
            error = GatewayError(exc.message, status_code=exc.status_code, param=exc.param, code=exc.code)
        except GatewayError as exc:
            error = exc
        if model not in settings.model_names:
            model = "unknown"  # bounded label: never a client-chosen string
        metrics.requests.labels(str(protocol), model, str(error.status_code)).inc()
        response = error_response(protocol, error)
        response.headers[wp.REQUEST_ID_HEADER] = request_id
        return response

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await handle(request, ApiProtocol.CHAT)

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        return await handle(request, ApiProtocol.RESPONSES)

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        return await handle(request, ApiProtocol.MESSAGES)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        created = request.app.state.gateway.started_at
        data = [{"id": m, "object": "model", "created": created, "owned_by": "deepseek"} for m in settings.model_names]
        return JSONResponse({"object": "list", "data": data})

    @app.get("/health")
    async def health() -> Response:
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready(request: Request) -> Response:
        healthy = len(request.app.state.gateway.registry.healthy())
        status = 200 if healthy else 503
        return JSONResponse({"status": "ready" if healthy else "no healthy worker", "healthy_workers": healthy},
                            status_code=status)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        protocol = ApiProtocol.MESSAGES if request.url.path.startswith("/v1/messages") else None
        return error_response(protocol, GatewayError(str(exc.detail), status_code=exc.status_code))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        return error_response(None, GatewayError(str(exc.errors()), status_code=400))

    return app
