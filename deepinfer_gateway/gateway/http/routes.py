"""The client-facing API: the route table and its endpoints.

`GENERATION_ROUTES` (path -> protocol) plus count_tokens are the fast routes: `ClientRoutes.
fast_routes()` turns them into endpoints and the app registers each once, with FastAPI and
its fast path (app.GatewayApp.add_fast_route). `/v1/models` goes through FastAPI.

A generation request: authenticate, read the body (size limit: no larger than could fit the
context), admit it (the key's model allow-list, a slot among its requests in flight, rate
limits), and only then prepare it (recipe_bridge: parsing, templating, tokenizing, images:
the costly part, never spent on a request refused anyway), then RequestServer.serve
(serving/server.py).
Every endpoint catches, counts (dgw_requests_total) and renders its own errors in the
protocol's JSON.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import orjson
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from deepinfer_gateway.config import ApiKey, GatewaySettings
from deepinfer_gateway.core import protocol as wp
from deepinfer_gateway.core.errors import (
    BridgeError,
    ClientGone,
    Forbidden,
    GatewayError,
    InternalError,
    PayloadTooLarge,
    RateLimited,
    Unauthorized,
)
from deepinfer_gateway.core.session_identity import SessionIdentity, identity_from, scoped
from deepinfer_gateway.gateway.serving.auth import presented_key
from deepinfer_gateway.gateway.serving.body_bound import body_limit
from deepinfer_gateway.gateway.serving.cache_salt import request_cache_salt
from deepinfer_gateway.gateway.serving.error_json import client_protocol, error_response
from deepinfer_gateway.gateway.serving.key_slots import KeySlots
from deepinfer_gateway.gateway.serving.ratelimit import Reservation
from deepinfer_gateway.gateway.serving.relay import RelayResponse
from deepinfer_gateway.gateway.serving.service_tier import flow_ticket
from deepinfer_gateway.gateway.state import GatewayState, gateway_state
from deepinfer_gateway.gateway.telemetry.logs import random_id
from deepinfer_gateway.gateway.telemetry.metrics import GatewayMetrics
from deepinfer_gateway.recipe_bridge.prepare import ApiProtocol, RequestPreparer

if TYPE_CHECKING:
    from fastapi import FastAPI

    from deepinfer_gateway.gateway.serving.conversations_api import ConversationsState
    from deepinfer_gateway.gateway.serving.responses_api import ResponsesState

log = logging.getLogger(__name__)

Endpoint = Callable[[Request], Awaitable[Response]]

GENERATION_ROUTES: dict[str, ApiProtocol] = {
    "/v1/chat/completions": ApiProtocol.CHAT,
    "/v1/responses": ApiProtocol.RESPONSES,
    "/v1/completions": ApiProtocol.COMPLETIONS,
    "/v1/messages": ApiProtocol.MESSAGES,
}
COUNT_TOKENS_PATH = "/v1/messages/count_tokens"
# dgw_requests_total `protocol` labels of the routes that are not a generation protocol.
MODELS = "models"
COUNT_TOKENS = "count_tokens"
STORED_RESPONSES = "stored_responses"  # GET/DELETE /v1/responses/{id}[/input_items], POST .../cancel
CONVERSATIONS = "conversations"  # /v1/conversations[/{id}[/items[/{item_id}]]]


def session_of(request: Request, key: ApiKey, body_session: str | None) -> SessionIdentity:
    """The request's session and parent (session_identity.py), keyed within its API key."""
    return scoped(identity_from(request.headers, body_session), key.scope)


async def authenticate(request: Request) -> ApiKey:
    key = await gateway_state(request).keys.lookup(presented_key(request.headers))
    if key is None:
        raise Unauthorized("Missing or invalid API key.")
    return key


def may_use(key: ApiKey, served: str, requested: str) -> bool:
    """A key's allow-list admits a served name and every alias of it, or an alias by its own name."""
    return key.allows(served) or key.allows(requested)


async def read_body(request: Request, limit: int, why: str = "") -> bytes:
    """The body, or PayloadTooLarge past `limit` bytes (`why`: appended to the message)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"Request body of {declared} bytes exceeds the limit of {limit} bytes{why}.")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"Request body exceeds the limit of {limit} bytes{why}.")
        chunks.append(chunk)
    return b"".join(chunks)


async def admit(state: GatewayState, key: ApiKey) -> dict[str, str]:
    """Rate limits before the body is prepared: one from the request bucket, and a token bucket
    not in debt; the x-ratelimit headers, or 429."""
    limits = (key.requests_per_minute, key.tokens_per_minute)
    if limits == (None, None):
        return {}
    verdict = await state.limiter.admit(key.scope, limits, 0)
    headers = verdict.headers()
    if not verdict.allowed:
        raise RateLimited(f"Rate limit reached for API key {key.name}; retry after {headers['retry-after']}s.",
                          headers=headers)
    return headers


async def reserve(state: GatewayState, key: ApiKey, prompt_tokens: int, max_tokens: int
                  ) -> tuple[dict[str, str], Reservation | None]:
    """Once prepared: its prompt and its whole max_tokens taken from the key's token bucket (the
    output it does not use comes back when it ends); the x-ratelimit headers, or 429."""
    limits = (key.requests_per_minute, key.tokens_per_minute)
    if key.tokens_per_minute is None:
        return {}, None
    verdict = await state.limiter.admit(key.scope, limits, prompt_tokens + max_tokens, requests=0)
    headers = verdict.headers()
    if not verdict.allowed:
        raise RateLimited(f"Token rate limit reached for API key {key.name} (this request reserves its prompt and "
                          f"max_tokens: {prompt_tokens + max_tokens}); retry after {headers['retry-after']}s.",
                          headers=headers)
    return headers, Reservation(state.limiter, key.scope, key.tokens_per_minute, max_tokens)


def ended(release_slot: Callable[[], None], reservation: Reservation | None) -> Callable[[int], None]:
    """A request's `on_done`: its slot back, its unused reserved tokens refunded."""
    def on_done(completion_tokens: int) -> None:
        release_slot()
        if reservation is not None:
            reservation.settle(completion_tokens)
    return on_done


async def unless_disconnected(request: Request, serving: Awaitable[Response]) -> Response:
    """Await `serving` (routing + waiting for the first token), but cancel it if the client
    leaves first, so a long prefill for a client that is gone is aborted on the worker.
    Streaming responses watch for disconnects themselves once they start."""
    task = asyncio.ensure_future(serving)
    watcher = asyncio.ensure_future(request.receive())  # the body is read: the next message is a disconnect
    try:
        try:
            done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            # Cancelled from outside (the server's grace period ran out): `serving` is a task
            # of its own, which asyncio.wait leaves running. Stop it and let its clean-up (the
            # worker call, the in-flight reservation) finish before this task ends.
            task.cancel()
            await asyncio.wait({task})
            raise
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


class ClientRoutes:
    """The endpoints clients call, over the settings, metrics and request preparer that
    `create_app` builds; per-request state (keys, limiter, server) comes from the lifespan."""

    def __init__(self, settings: GatewaySettings, metrics: GatewayMetrics, preparer: RequestPreparer) -> None:
        self.settings = settings
        self.metrics = metrics
        self.preparer = preparer
        self.body_limit, self.body_limit_why = body_limit(settings)
        self.key_slots = KeySlots(settings.client_connections.max_requests_per_key)

    def fast_routes(self) -> dict[str, Endpoint]:
        """Path -> endpoint of every POST route the app's fast path serves."""
        routes = {path: self._generation_endpoint(protocol) for path, protocol in GENERATION_ROUTES.items()}
        routes[COUNT_TOKENS_PATH] = self.count_tokens
        return routes

    def _generation_endpoint(self, protocol: ApiProtocol) -> Endpoint:
        async def endpoint(request: Request) -> Response:
            return await self.generate(request, protocol)
        endpoint.__name__ = str(protocol)
        return endpoint

    def count(self, label: str, model: str, status: int) -> None:
        """dgw_requests_total for an answer given here; `label` is the protocol (or `models`,
        `count_tokens`). Answers from a worker are counted by relay.Relay.close."""
        if model not in self.settings.model_names:
            model = "unknown"  # bounded label: never a client-chosen string
        self.metrics.count_request(label, model, status)

    def refuse(self, label: str, protocol: ApiProtocol | None, model: str, error: GatewayError,
               request_id: str | None = None) -> Response:
        self.count(label, model, error.status_code)
        response = error_response(protocol, error)
        if request_id is not None:
            response.headers[wp.REQUEST_ID_HEADER] = request_id
        return response

    def caught(self, exc: Exception, request_id: str) -> GatewayError:
        """The GatewayError an endpoint answers for an exception it caught."""
        if isinstance(exc, (ClientGone, ClientDisconnect)):  # gone while we read its body or awaited a token
            self.metrics.client_disconnects.inc()
            return ClientGone()
        if isinstance(exc, GatewayError):
            return exc
        log.error("request %s failed unexpectedly", request_id, exc_info=exc)
        return InternalError()

    async def generate(self, request: Request, protocol: ApiProtocol) -> Response:
        arrival = time.perf_counter()
        state = gateway_state(request)
        request_id = request.headers.get(wp.REQUEST_ID_HEADER) or random_id()
        model = "unknown"
        release_slot = None
        reservation = None
        try:
            key = await authenticate(request)
            body = await read_body(request, self.body_limit, self.body_limit_why)
            self.check_model_early(key, body)
            release_slot = self.key_slots.take(key)
            headers = await admit(state, key)  # its tokens are reserved once counted
            pending = None
            if protocol is ApiProtocol.RESPONSES:
                body, pending = await state.responses.prepare(key.scope, body)
            prepared = await self.preparer.prepare_async(protocol, body)
            model = prepared.model
            self.metrics.preprocess.observe(time.perf_counter() - arrival)
            if not may_use(key, model, prepared.requested_model):
                raise Forbidden(f"This API key may not use model {prepared.requested_model}.")
            flow = flow_ticket(self.settings.flow_control, key, prepared, request.headers)
            reserved, reservation = await reserve(state, key, prepared.prompt_tokens, prepared.sampling.max_tokens)
            headers = {**headers, **reserved}
            on_done = ended(release_slot, reservation)
            serving = state.server.serve(prepared, request_id, arrival, workload_class=key.workload_class,
                                         headers=headers, on_done=on_done,
                                         session=session_of(request, key, prepared.user),
                                         cache_salt=request_cache_salt(key, prepared.cache_salt), flow=flow,
                                         response_id=pending.response_id if pending is not None else None)
            if pending is not None and pending.background is not None:
                release_slot = None  # the run gives it back when it ends
                started = await state.responses.start_background(pending, serving, functools.partial(on_done, 0))
                started.headers.update({**headers, wp.REQUEST_ID_HEADER: request_id})  # as a served request's
                return started
            response = await unless_disconnected(request, serving)
            if isinstance(response, RelayResponse):
                release_slot = None  # the stream's end gives the slot back (`on_done`)
            return response if pending is None else await state.responses.capture(pending, response)
        except Exception as exc:  # any failure is answered in the protocol's error JSON
            if reservation is not None:
                reservation.settle(0)  # no-op when it reached a worker (its end settled it)
            if isinstance(exc, BridgeError) and exc.model:
                model = exc.model
            return self.refuse(str(protocol), protocol, model, self.caught(exc, request_id), request_id)
        finally:
            if release_slot is not None:
                release_slot()

    def check_model_early(self, key: ApiKey, body: bytes) -> None:
        """A key with an allow-list is refused a model it may not use before its body is prepared.
        A body this cannot read is left to the preparer, which answers it; it checks again."""
        if not key.models:
            return
        try:
            requested = orjson.loads(body).get("model")
        except (orjson.JSONDecodeError, AttributeError):
            return
        target = self.preparer.catalog.resolve(requested) if isinstance(requested, str) else None
        if target is not None and not may_use(key, target.served, requested):
            raise Forbidden(f"This API key may not use model {requested}.")

    async def count_tokens(self, request: Request) -> Response:
        """Anthropic's `POST /v1/messages/count_tokens`: the Messages body's prompt tokens.

        Rate limits: it takes one request from the key's request bucket and is refused while
        either bucket is empty, but spends no tokens (nothing is generated or prefilled)."""
        request_id = request.headers.get(wp.REQUEST_ID_HEADER) or random_id()
        model = "unknown"
        try:
            key = await authenticate(request)
            body = await read_body(request, self.body_limit, self.body_limit_why)
            self.check_model_early(key, body)
            headers = await admit(gateway_state(request), key)
            counted = await self.preparer.count_tokens_async(body)
            model = counted.model
            if not may_use(key, model, counted.requested_model):
                raise Forbidden(f"This API key may not use model {counted.requested_model}.")
        except Exception as exc:  # any failure is answered in the protocol's error JSON
            if isinstance(exc, BridgeError) and exc.model:
                model = exc.model
            return self.refuse(COUNT_TOKENS, ApiProtocol.MESSAGES, model, self.caught(exc, request_id), request_id)
        self.count(COUNT_TOKENS, model, 200)
        return JSONResponse({"input_tokens": counted.input_tokens},
                            headers={**headers, wp.REQUEST_ID_HEADER: request_id})

    def model_card(self, name: str, served: str, created: int, protocol: ApiProtocol | None) -> dict[str, Any]:
        """vLLM's model object (`max_model_len`: the context limit; aliases name their served
        model in `root`/`parent`), or Anthropic's for the Anthropic SDK."""
        if protocol is ApiProtocol.MESSAGES:
            created_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(created))
            return {"type": "model", "id": name, "display_name": name, "created_at": created_at}
        return {"id": name, "object": "model", "created": created, "owned_by": "deepseek", "root": served,
                "parent": None if name == served else served, "max_model_len": self.settings.context_limit}

    async def models(self, request: Request) -> Response:
        """`GET /v1/models`: the names the caller's key may use, served names then aliases."""
        protocol = client_protocol(request.url.path, request.headers)
        try:
            key = await authenticate(request)
        except GatewayError as exc:
            return self.refuse(MODELS, protocol, "unknown", exc)
        created = gateway_state(request).started_at
        data = [self.model_card(name, served, created, protocol)
                for name, served in self.preparer.catalog.visible(key.allows)]
        self.count(MODELS, "unknown", 200)
        if protocol is ApiProtocol.MESSAGES:
            return JSONResponse({"data": data, "has_more": False, "first_id": data[0]["id"] if data else None,
                                 "last_id": data[-1]["id"] if data else None})
        return JSONResponse({"object": "list", "data": data})

    async def model_info(self, model_id: str, request: Request) -> Response:
        """`GET /v1/models/{model_id}`: one model card, 404 for a name the key may not use."""
        protocol = client_protocol(request.url.path, request.headers)
        target = self.preparer.catalog.resolve(model_id)
        try:
            key = await authenticate(request)
            if target is None or not may_use(key, target.served, model_id):
                raise BridgeError.model_not_found(model_id)
        except GatewayError as exc:
            return self.refuse(MODELS, protocol, target.served if target else "unknown", exc)
        self.count(MODELS, target.served, 200)
        return JSONResponse(self.model_card(model_id, target.served, gateway_state(request).started_at, protocol))

    # --- stored Responses (responses_api.py) ------------------------------------------------
    def add_stored_responses(self, app: FastAPI) -> None:
        app.add_api_route("/v1/responses/{response_id}", self.retrieve_response, methods=["GET"])
        app.add_api_route("/v1/responses/{response_id}", self.delete_response, methods=["DELETE"])
        app.add_api_route("/v1/responses/{response_id}/input_items", self.response_input_items, methods=["GET"])
        app.add_api_route("/v1/responses/{response_id}/cancel", self.cancel_response, methods=["POST"])

    async def _stored_response_call(self, request: Request,
                                    call: Callable[[ResponsesState, str], Awaitable[Response]]) -> Response:
        try:
            key = await authenticate(request)
            response = await call(gateway_state(request).responses, key.scope)
        except GatewayError as exc:
            return self.refuse(STORED_RESPONSES, ApiProtocol.RESPONSES, "unknown", exc)
        self.count(STORED_RESPONSES, "unknown", response.status_code)
        return response

    async def retrieve_response(self, response_id: str, request: Request) -> Response:
        """`GET /v1/responses/{id}`: a stored response of the caller's key (another key's: 404)."""
        return await self._stored_response_call(
            request, lambda responses, owner: responses.retrieve(owner, response_id, request))

    async def delete_response(self, response_id: str, request: Request) -> Response:
        """`DELETE /v1/responses/{id}`."""
        return await self._stored_response_call(request, lambda responses, owner: responses.delete(owner, response_id))

    async def cancel_response(self, response_id: str, request: Request) -> Response:
        """`POST /v1/responses/{id}/cancel`: a background response still running."""
        return await self._stored_response_call(request, lambda responses, owner: responses.cancel(owner, response_id))

    async def response_input_items(self, response_id: str, request: Request) -> Response:
        """`GET /v1/responses/{id}/input_items` (`limit`, `order`, `after`)."""
        return await self._stored_response_call(
            request, lambda responses, owner: responses.list_input_items(owner, response_id, request))

    # --- conversations (conversations_api.py) ---------------------------------------------
    def add_conversations(self, app: FastAPI) -> None:
        base, item = "/v1/conversations/{conversation_id}", "/v1/conversations/{conversation_id}/items/{item_id}"
        app.add_api_route("/v1/conversations", self.create_conversation, methods=["POST"])
        app.add_api_route(base, self.retrieve_conversation, methods=["GET"])
        app.add_api_route(base, self.update_conversation, methods=["POST"])
        app.add_api_route(base, self.delete_conversation, methods=["DELETE"])
        app.add_api_route(base + "/items", self.list_conversation_items, methods=["GET"])
        app.add_api_route(base + "/items", self.add_conversation_items, methods=["POST"])
        app.add_api_route(item, self.retrieve_conversation_item, methods=["GET"])
        app.add_api_route(item, self.delete_conversation_item, methods=["DELETE"])

    async def _conversations_call(self, request: Request,
                                  call: Callable[[ConversationsState, str, bytes], Awaitable[Response]]) -> Response:
        try:
            key = await authenticate(request)
            # a POST's body is bounded as a generation request's
            body = await read_body(request, self.body_limit, self.body_limit_why) if request.method == "POST" else b""
            response = await call(gateway_state(request).conversations, key.scope, body)
        except Exception as exc:  # any failure is answered in the Responses API's error JSON
            return self.refuse(CONVERSATIONS, ApiProtocol.RESPONSES, "unknown", self.caught(exc, random_id()))
        self.count(CONVERSATIONS, "unknown", response.status_code)
        return response

    async def create_conversation(self, request: Request) -> Response:
        """`POST /v1/conversations` (`items`, `metadata`)."""
        return await self._conversations_call(request, lambda c, owner, body: c.create(owner, body))

    async def retrieve_conversation(self, conversation_id: str, request: Request) -> Response:
        """`GET /v1/conversations/{id}`: a conversation of the caller's key (another key's: 404)."""
        return await self._conversations_call(request, lambda c, owner, body: c.retrieve(owner, conversation_id))

    async def update_conversation(self, conversation_id: str, request: Request) -> Response:
        """`POST /v1/conversations/{id}` (`metadata`)."""
        return await self._conversations_call(request, lambda c, owner, body: c.update(owner, conversation_id, body))

    async def delete_conversation(self, conversation_id: str, request: Request) -> Response:
        """`DELETE /v1/conversations/{id}`."""
        return await self._conversations_call(request, lambda c, owner, body: c.delete(owner, conversation_id))

    async def list_conversation_items(self, conversation_id: str, request: Request) -> Response:
        """`GET /v1/conversations/{id}/items` (`after`, `limit`, `order`)."""
        return await self._conversations_call(request,
                                              lambda c, owner, body: c.list_items(owner, conversation_id, request))

    async def add_conversation_items(self, conversation_id: str, request: Request) -> Response:
        """`POST /v1/conversations/{id}/items` (`items`)."""
        return await self._conversations_call(
            request, lambda c, owner, body: c.add_items(owner, conversation_id, request, body))

    async def retrieve_conversation_item(self, conversation_id: str, item_id: str, request: Request) -> Response:
        """`GET /v1/conversations/{id}/items/{item_id}`."""
        return await self._conversations_call(
            request, lambda c, owner, body: c.retrieve_item(owner, conversation_id, item_id, request))

    async def delete_conversation_item(self, conversation_id: str, item_id: str, request: Request) -> Response:
        """`DELETE /v1/conversations/{id}/items/{item_id}`: answers the conversation."""
        return await self._conversations_call(
            request, lambda c, owner, body: c.delete_item(owner, conversation_id, item_id))
