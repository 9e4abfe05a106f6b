"""Stateful Responses: `store`, `previous_response_id`, and `GET`/`DELETE /v1/responses/{id}`
with `GET /v1/responses/{id}/input_items`, over a `ResponseStore` (response_store.py).

A `POST /v1/responses` body goes through `ResponsesState.prepare` before the preparer sees
it: `background` and `conversation` are refused (400, naming the field); a
`previous_response_id` of this key's is replaced by the stored conversation (its input and
its output items) followed by the new input (an unknown or another key's id: 404); with
`store` (default true, as OpenAI) the key's room is checked and `capture` keeps the answer,
before its final event or body reaches the client, so a `retrieve` right after succeeds.

While the store fails (a Redis outage) or all keys' responses fill its byte budget, a new
response is served unstored: the body the preparer gets says `store: false`, so the response
object the client receives says so too, and `dgw_responses_not_stored_total{reason}` counts
it. What needs the stored state (`previous_response_id`, GET, DELETE) answers 503 with
`Retry-After` meanwhile. The outage is logged once when it starts and once when it ends
(outage.py), and while it lasts the store is tried once a second, not once per request.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Message, Send

from deepinfer_gateway.errors import GatewayError
from deepinfer_gateway.gateway.serving.relay import RelayResponse
from deepinfer_gateway.gateway.serving.response_store import ResponseStore, StoredResponse, StoreExhausted
from deepinfer_gateway.outage import Outage

log = logging.getLogger(__name__)
T = TypeVar("T")

_FINAL_EVENTS = (b"event: response.completed", b"event: response.incomplete")
# The events that carry the response object, with its `store`.
_RESPONSE_EVENTS = (b"event: response.created", b"event: response.in_progress", *_FINAL_EVENTS)
_INPUT_ROLE_TEXT = {"user": "input_text", "system": "input_text", "developer": "input_text",
                    "assistant": "output_text"}


class BadField(GatewayError):
    status_code = 400

    def __init__(self, field: str, message: str):
        super().__init__(message, param=field, code="invalid_request_error")


class StoreUnavailable(GatewayError):
    status_code = 503

    def __init__(self) -> None:
        super().__init__("Stored responses cannot be reached right now; retry shortly.", code="store_unavailable",
                         headers={"retry-after": "1"})


class ResponseNotFound(GatewayError):
    status_code = 404

    def __init__(self, response_id: str, field: str | None = None):
        what = "Previous response" if field else "Response"
        super().__init__(f"{what} with id '{response_id}' not found.", param=field, code="not_found")


def input_items(value: Any) -> list[dict[str, Any]]:
    """A Responses `input` (a string or a list of items) as typed items with ids, as OpenAI lists them."""
    if isinstance(value, str):
        value = [{"role": "user", "content": value}]
    if not isinstance(value, list):
        raise BadField("input", "input must be a string or a list of input items.")
    items = []
    for item in value:
        if not isinstance(item, dict):
            raise BadField("input", "each input item must be an object.")
        item = dict(item)
        if "type" not in item and "role" in item:
            item["type"] = "message"
        if item.get("type") == "message" and isinstance(item.get("content"), str):
            kind = _INPUT_ROLE_TEXT.get(str(item.get("role")), "input_text")
            item["content"] = [{"type": kind, "text": item["content"]}]
        item.setdefault("id", f"{'msg' if item.get('type') == 'message' else 'item'}_{uuid.uuid4().hex}")
        items.append(item)
    return items


# A body naming none of these is a plain new conversation to store: it is not parsed here (the
# preparer parses it, off the event loop when large); its input items are read once it is answered.
# A `\u` escape could spell one of them: such a body is parsed.
_STATE_KEYS = (b'"previous_response_id"', b'"background"', b'"conversation"', b'"store"', b"\\u")


@dataclass(frozen=True, slots=True)
class Pending:
    """What `capture` stores with the answer: its owner and the whole input it answers (the
    expanded items, or the body they are read from)."""

    owner: str
    items: list[dict[str, Any]] | None = None
    body: bytes = b""

    def input_items(self) -> list[dict[str, Any]]:
        if self.items is not None:
            return self.items
        obj = orjson.loads(self.body)
        return input_items(obj.get("input", []) if isinstance(obj, dict) else [])


# dgw_responses_not_stored_total reasons
UNAVAILABLE = "unavailable"  # the store failed (a Redis outage)
FULL = "full"  # all keys' responses fill responses.max_total_bytes
REFUSED = "refused"  # the answer, once generated, was over max_bytes or the key's bytes


class ResponsesState:
    def __init__(self, store: ResponseStore | None, on_error: Callable[[], None] = lambda: None,
                 on_not_stored: Callable[[str], None] = lambda reason: None):
        self.store = store  # None: storing is off (settings.responses.store)
        self.on_not_stored = on_not_stored
        self._outage = Outage("stored responses", "new responses served unstored, stored ones answered 503",
                              on_error)

    async def _call(self, operation: Callable[[], Awaitable[T]]) -> T:
        """Run a store operation; StoreUnavailable when it fails (or is known to be failing)."""
        if not self._outage.due():
            raise StoreUnavailable()
        try:
            result = await operation()
        except (GatewayError, StoreExhausted):
            self._outage.ok()
            raise
        except Exception as exc:
            self._outage.failed(exc)
            raise StoreUnavailable() from None
        self._outage.ok()
        return result

    async def _room(self, owner: str, body: bytes) -> str | None:
        """None when the owner has room for one more (at least the body's size: the stored record
        holds its input); else why this response is served unstored."""
        kept = self.store
        assert kept is not None
        try:
            await self._call(lambda: kept.check_room(owner, len(body)))
        except StoreUnavailable:
            return UNAVAILABLE
        except StoreExhausted:
            return FULL
        return None

    def _unstored(self, obj: dict[str, Any], reason: str) -> tuple[bytes, None]:
        self.on_not_stored(reason)
        obj["store"] = False  # the response object answered says so
        return orjson.dumps(obj), None

    async def prepare(self, owner: str, body: bytes) -> tuple[bytes, Pending | None]:
        """The body the preparer gets, and what to store with its answer (None: not stored)."""
        if not any(key in body for key in _STATE_KEYS):
            if self.store is None:
                return body, None
            reason = await self._room(owner, body)
            if reason is None:
                return body, Pending(owner, body=body)
            try:
                obj = orjson.loads(body)
            except orjson.JSONDecodeError:
                return body, None  # the preparer answers the 400
            return self._unstored(obj, reason) if isinstance(obj, dict) else (body, None)
        try:
            obj = orjson.loads(body)
        except orjson.JSONDecodeError:
            return body, None  # the preparer answers the 400
        if not isinstance(obj, dict):
            return body, None
        if obj.get("background"):
            raise BadField("background", "background: true is not supported by this gateway; stream the response "
                                         "instead (stream: true), or send background: false.")
        if obj.get("conversation") is not None:
            raise BadField("conversation", "The Conversations API is not supported by this gateway; continue a "
                                           "conversation with previous_response_id.")
        store = obj.get("store", self.store is not None)
        if not isinstance(store, bool):
            raise BadField("store", "store must be true or false.")
        if store and self.store is None:
            raise BadField("store", "Storing responses is turned off on this gateway (responses.store); "
                                    "send store: false.")
        items = input_items(obj.get("input", []))
        previous_id = obj.get("previous_response_id")
        if previous_id is not None:
            kept = self.store
            if not isinstance(previous_id, str) or kept is None:
                raise ResponseNotFound(str(previous_id), "previous_response_id")
            previous = await self._call(lambda: kept.get(owner, previous_id))
            if previous is None:
                raise ResponseNotFound(previous_id, "previous_response_id")
            items = previous.input_items + _replayable(previous.response.get("output") or []) + items
            obj["input"] = items
            body = orjson.dumps(obj)
        if not store or self.store is None:
            return body, None
        reason = await self._room(owner, body)
        if reason is not None:
            return self._unstored(obj, reason)
        return body, Pending(owner, items=items)

    async def capture(self, pending: Pending, response: Response) -> Response:
        """Store the answer before its last part reaches the client (an error answer is not stored).
        The response object the client gets says whether it was stored (`store`)."""
        if response.status_code != 200:
            return response
        if not isinstance(response, RelayResponse):  # one JSON body
            answered = orjson.loads(response.body)
            answered["store"] = await self._keep(pending, answered)
            response.body = orjson.dumps(answered)
            response.headers["content-length"] = str(len(response.body))
            return response
        writer = response.body_writer
        response.body_writer = lambda send: writer(self._teeing(pending, send))
        return response

    def _teeing(self, pending: Pending, send: Send) -> Send:
        kept = False

        async def tee(message: Message) -> None:
            nonlocal kept
            body = message.get("body", b"")
            if kept or message["type"] != "http.response.body" or not any(e in body for e in _RESPONSE_EVENTS):
                await send(message)
                return
            stored = True  # the events before the last: as asked (its room was checked)
            if any(e in body for e in _FINAL_EVENTS):
                final = _final_response(body)
                if final is not None:
                    kept = True
                    stored = await self._keep(pending, final)
            await send({**message, "body": _with_store(body, stored)})
        return tee

    async def _keep(self, pending: Pending, response: dict[str, Any]) -> bool:
        """Whether it was stored. Never raises: the answer is on its way to the client."""
        kept = self.store
        assert kept is not None
        try:
            stored = StoredResponse({**response, "store": True}, pending.input_items())
            await self._call(lambda: kept.put(pending.owner, str(response["id"]), stored))
        except StoreUnavailable:  # logged once per outage
            self.on_not_stored(UNAVAILABLE)
        except StoreExhausted:
            self.on_not_stored(FULL)
        except GatewayError as exc:
            self.on_not_stored(REFUSED)
            log.warning("response %s not stored: %s", response.get("id"), exc.message)
        except Exception:  # a bug here must not break an answer already on its way
            self.on_not_stored(REFUSED)
            log.exception("response %s not stored", response.get("id"))
        else:
            return True
        return False

    # --- the routes --------------------------------------------------------------------------
    async def _stored(self, owner: str, response_id: str) -> StoredResponse:
        kept = self.store
        found = await self._call(lambda: kept.get(owner, response_id)) if kept is not None else None
        if found is None:
            raise ResponseNotFound(response_id)
        return found

    async def retrieve(self, owner: str, response_id: str, request: Request) -> Response:
        if request.query_params.get("stream", "false").lower() == "true":
            raise BadField("stream", "Streaming a stored response again is not supported; retrieve it without "
                                     "stream.")
        return JSONResponse((await self._stored(owner, response_id)).response)

    async def delete(self, owner: str, response_id: str) -> Response:
        kept = self.store
        if kept is None or not await self._call(lambda: kept.delete(owner, response_id)):
            raise ResponseNotFound(response_id)
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    async def list_input_items(self, owner: str, response_id: str, request: Request) -> Response:
        items = (await self._stored(owner, response_id)).input_items
        params = request.query_params
        order = params.get("order", "desc")
        if order not in ("asc", "desc"):
            raise BadField("order", "order must be asc or desc.")
        try:
            limit = int(params.get("limit", "20"))
        except ValueError:
            raise BadField("limit", "limit must be an integer from 1 to 100.") from None
        if not 1 <= limit <= 100:
            raise BadField("limit", "limit must be an integer from 1 to 100.")
        ordered = items[::-1] if order == "desc" else items
        after = params.get("after")
        if after is not None:
            ids = [item.get("id") for item in ordered]
            if after not in ids:
                raise BadField("after", f"No input item with id '{after}' in this response.")
            ordered = ordered[ids.index(after) + 1:]
        page = ordered[:limit]
        return JSONResponse({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                             "last_id": page[-1]["id"] if page else None, "has_more": len(ordered) > limit})


def _replayable(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A stored response's output items as the next request's input: its messages, tool calls and
    their results. Reasoning is left out: the chat template drops an earlier turn's reasoning."""
    return [item for item in output if item.get("type") != "reasoning"]


def _final_response(chunk: bytes) -> dict[str, Any] | None:
    """The response object in an SSE chunk holding a `response.completed`/`.incomplete` event."""
    for line in chunk.split(b"\n"):
        if line.startswith(b"data: "):
            try:
                event = orjson.loads(line[6:])
            except orjson.JSONDecodeError:
                continue
            if isinstance(event, dict) and event.get("type") in ("response.completed", "response.incomplete"):
                response = event.get("response")
                return response if isinstance(response, dict) else None
    return None


def _with_store(chunk: bytes, stored: bool) -> bytes:
    """An SSE chunk with `store` of each response object it carries set to `stored`."""
    lines = chunk.split(b"\n")
    for i, line in enumerate(lines):
        if line.startswith(b"data: ") and b'"store"' in line:
            try:
                event = orjson.loads(line[6:])
            except orjson.JSONDecodeError:
                continue
            response = event.get("response") if isinstance(event, dict) else None
            if isinstance(response, dict):
                response["store"] = stored
                lines[i] = b"data: " + orjson.dumps(event)
    return b"\n".join(lines)
