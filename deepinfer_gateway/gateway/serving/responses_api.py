"""Stateful Responses: `store`, `previous_response_id`, `conversation`, `background`, and
`GET`/`DELETE /v1/responses/{id}` with `GET /v1/responses/{id}/input_items` and `POST
/v1/responses/{id}/cancel`, over a `ResponseStore` (response_store.py).

A `POST /v1/responses` body goes through `ResponsesState.prepare` before the preparer sees
it: `background: true` (with store) is answered at once and run as a task
(background_responses.py: `start_background`, `cancel`, `retrieve` with `stream=true`); a
`previous_response_id` of this key's is replaced by the stored conversation (its input and
its output items) followed by the new input (an unknown or another key's id: 404); a
`conversation` (conversations_api.py) likewise by that conversation's items, and its new input
and output are appended to it once answered (a failed append is logged and counted,
`dgw_conversation_appends_failed_total`: the answer is already on its way); with `store`
(default true, as OpenAI) the key's room is checked and `capture` keeps the answer, before its
final event or body reaches the client, so a `retrieve` right after succeeds.

While the store fails (a Redis outage) or all keys' responses fill its byte budget, a new
response is served unstored: the body the preparer gets says `store: false`, so the response
object the client receives says so too, and `dgw_responses_not_stored_total{reason}` counts
it. What needs the stored state (`previous_response_id`, GET, DELETE) answers 503 with
`Retry-After` meanwhile. The outage is logged once when it starts and once when it ends
(outage.py), and while it lasts the store is tried once a second, not once per request.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Message, Send

from deepinfer_gateway.core.errors import GatewayError
from deepinfer_gateway.core.outage import Outage
from deepinfer_gateway.gateway.serving.background_responses import BackgroundResponses, Run
from deepinfer_gateway.gateway.serving.background_store import BackgroundStore
from deepinfer_gateway.gateway.serving.relay import RelayResponse
from deepinfer_gateway.gateway.serving.response_store import ResponseStore, StoredResponse, StoreExhausted
from deepinfer_gateway.recipe_bridge.includes import NONE, includes_of, items_view, replayable, response_view

log = logging.getLogger(__name__)
T = TypeVar("T")


async def through_outage(outage: Outage, operation: Callable[[], Awaitable[T]],
                         answers: tuple[type[BaseException], ...] = (GatewayError,)) -> T:
    """A store operation behind its `Outage`: StoreUnavailable while the store is known to be
    down or when the operation fails; the store's own refusals (`answers`) pass through and
    count as the store answering."""
    if not outage.due():
        raise StoreUnavailable()
    try:
        result = await operation()
    except answers:
        outage.ok()
        raise
    except Exception as exc:
        outage.failed(exc)
        raise StoreUnavailable() from None
    outage.ok()
    return result


class Conversations(Protocol):
    """What Responses needs of the Conversations API (conversations_api.ConversationsState,
    which builds on this module): a conversation's items as a request's context, and the
    request's new items appended once answered."""

    @property
    def store(self) -> object | None:
        """None: conversations are turned off."""

    async def context(self, owner: str, conversation: Any, new: list[dict[str, Any]]
                      ) -> tuple[str, list[dict[str, Any]]]: ...

    async def append(self, owner: str, conversation_id: str, items: list[dict[str, Any]]) -> None: ...

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
    """What `capture` keeps of the answer: its owner and the whole input it answers (the
    expanded items, or the body they are read from); whether it is stored; the conversation
    its new input and output are appended to."""

    owner: str
    items: list[dict[str, Any]] | None = None
    body: bytes = b""
    store: bool = True
    conversation: str | None = None
    new_items: list[dict[str, Any]] = field(default_factory=list)  # this request's own input
    background: dict[str, Any] | None = None  # a background response's queued response object
    stream: bool = False  # a background response's client asked for a stream

    @property
    def response_id(self) -> str | None:
        return None if self.background is None else str(self.background["id"])

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
                 on_not_stored: Callable[[str], None] = lambda reason: None,
                 conversations: Conversations | None = None,
                 on_not_appended: Callable[[], None] = lambda: None,
                 background: BackgroundStore | None = None,
                 on_background_end: Callable[[str], None] = lambda outcome: None):
        self.store = store  # None: storing is off (settings.responses.store)
        self.on_not_stored = on_not_stored
        self.conversations = conversations
        self.on_not_appended = on_not_appended
        self.background = None if background is None else BackgroundResponses(background, self._call,
                                                                              on_background_end)
        self._outage = Outage("stored responses", "new responses served unstored, stored ones answered 503",
                              on_error)

    async def _call(self, operation: Callable[[], Awaitable[T]]) -> T:
        """Run a store operation; StoreUnavailable when it fails (or is known to be failing)."""
        return await through_outage(self._outage, operation, (GatewayError, StoreExhausted))

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
        background = obj.get("background", False)
        if not isinstance(background, bool):
            raise BadField("background", "background must be true or false.")
        store = obj.get("store", self.store is not None)
        if not isinstance(store, bool):
            raise BadField("store", "store must be true or false.")
        if background and (not store or self.background is None):
            raise BadField("background", "background: true needs store: true (a background response is read from "
                                         "the store), and storing responses on (responses.store).")
        if store and self.store is None:
            raise BadField("store", "Storing responses is turned off on this gateway (responses.store); "
                                    "send store: false.")
        items = input_items(obj.get("input", []))
        previous_id = obj.get("previous_response_id")
        conversation, new_items = None, items
        if obj.get("conversation") is not None:
            if previous_id is not None:
                raise BadField("conversation", "conversation and previous_response_id cannot both be given.")
            if self.conversations is None or self.conversations.store is None:
                raise BadField("conversation", "The Conversations API is turned off on this gateway "
                                               "(conversations.enabled).")
            conversation, history = await self.conversations.context(owner, obj["conversation"], items)
            items = _replayable(history) + items
            obj["input"] = items
            del obj["conversation"]
            body = orjson.dumps(obj)
        elif previous_id is not None:
            kept = self.store
            if not isinstance(previous_id, str) or kept is None:
                raise ResponseNotFound(str(previous_id), "previous_response_id")
            previous = await self._call(lambda: kept.get(owner, previous_id))
            if previous is None:
                raise ResponseNotFound(previous_id, "previous_response_id")
            if self.background is not None:  # a background run whose gateway died is failed here
                previous = await self.background.settle(owner, previous_id, previous)
            status = previous.response.get("status")
            if status in ("queued", "in_progress"):  # a background response still running
                raise BadField("previous_response_id", f"Response '{previous_id}' is still {status}; continue it "
                                                       "once it has ended.")
            items = previous.input_items + _replayable(previous.response.get("output") or []) + items
            obj["input"] = items
            body = orjson.dumps(obj)
        if background:
            return self._background(owner, obj, items, conversation, new_items)
        if conversation is not None:
            if store:
                reason = await self._room(owner, body)
                if reason is not None:
                    self.on_not_stored(reason)
                    store = False
            obj["store"] = store  # the response object answered says so
            pending = Pending(owner, items=items, store=store, conversation=conversation, new_items=new_items)
            return orjson.dumps(obj), pending
        if not store or self.store is None:
            return body, None
        reason = await self._room(owner, body)
        if reason is not None:
            return self._unstored(obj, reason)
        return body, Pending(owner, items=items)

    def _background(self, owner: str, obj: dict[str, Any], items: list[dict[str, Any]], conversation: str | None,
                    new_items: list[dict[str, Any]]) -> tuple[bytes, Pending]:
        """A background response: always streamed from the worker (its events are its progress),
        stored (its room is checked as it is recorded queued)."""
        stream = obj.get("stream") is True
        queued = queued_response(obj, f"resp_{uuid.uuid4().hex}", conversation)
        obj.update({"stream": True, "store": True})
        obj.pop("conversation", None)
        return orjson.dumps(obj), Pending(owner, items=items, conversation=conversation, new_items=new_items,
                                          background=queued, stream=stream)

    async def start_background(self, pending: Pending, serving: Awaitable[Response],
                               on_end: Callable[[], None]) -> Response:
        """Run a background response (background_responses.py); the answer to its POST."""
        runs, queued = self.background, pending.background
        assert runs is not None and queued is not None
        extra = _said(pending, True) | {"background": True}
        run = Run(pending.owner, str(queued["id"]), queued, pending.input_items(), pending.stream, extra,
                  lambda final: self._append(pending, final) if pending.conversation else _nothing())
        try:
            return await runs.start(run, serving, on_end)
        except StoreExhausted:
            raise GatewayError("Stored responses fill this gateway's budget (responses.max_total_bytes); a background "
                               "response cannot be kept: send background: false.", status_code=503,
                               code="store_full") from None

    async def capture(self, pending: Pending, response: Response) -> Response:
        """Store the answer before its last part reaches the client (an error answer is not stored).
        The response object the client gets says whether it was stored (`store`)."""
        if response.status_code != 200:
            return response
        if not isinstance(response, RelayResponse):  # one JSON body
            answered = orjson.loads(response.body)
            answered.update(await self._keep(pending, answered))
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
            fields = _said(pending, pending.store)  # the events before the last: as asked
            if any(e in body for e in _FINAL_EVENTS):
                final = _final_response(body)
                if final is not None:
                    kept = True
                    fields = await self._keep(pending, final)
            await send({**message, "body": _with_fields(body, fields)})
        return tee

    async def _keep(self, pending: Pending, response: dict[str, Any]) -> dict[str, Any]:
        """Store it and append it to its conversation; the response object's fields that say so.
        Never raises: the answer is on its way to the client."""
        if pending.conversation is not None:
            await self._append(pending, response)
        return _said(pending, pending.store and await self._put(pending, response))

    async def _append(self, pending: Pending, response: dict[str, Any]) -> None:
        conversations = self.conversations
        assert conversations is not None and pending.conversation is not None
        output = [item for item in response.get("output") or [] if isinstance(item, dict)]
        added = pending.new_items + input_items(output)  # each with an id
        try:
            await conversations.append(pending.owner, pending.conversation, added)
        except Exception as exc:  # deleted meanwhile, full, or the store failing: the answer goes out
            self.on_not_appended()
            log.warning("response %s not appended to conversation %s: %s", response.get("id"),
                        pending.conversation, getattr(exc, "message", exc))

    async def _put(self, pending: Pending, response: dict[str, Any]) -> bool:
        """Whether it was stored."""
        kept = self.store
        assert kept is not None
        try:
            stored = StoredResponse({**response, **_said(pending, True)}, pending.input_items())
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
        if self.background is not None:  # a background run whose gateway died is failed here
            found = await self.background.settle(owner, response_id, found)
        return found

    async def retrieve(self, owner: str, response_id: str, request: Request) -> Response:
        """The stored response (its logprobs as `include` asks), or with `stream=true` a background
        response's events again, as they were sent."""
        params = request.query_params
        stream = params.get("stream", "false").lower()
        if stream not in ("true", "false"):
            raise BadField("stream", "stream must be true or false.")
        includes = query_includes(request)
        stored = await self._stored(owner, response_id)
        if stream == "false":
            if "starting_after" in params:
                raise BadField("starting_after", "starting_after needs stream=true.")
            return JSONResponse(response_view(stored.response, includes))
        runs = self.background
        if runs is None or not await runs.streamable(owner, response_id):
            raise BadField("stream", "Only a response created with background: true and stream: true can be streamed "
                                     "again; retrieve it without stream.")
        try:
            after = int(params.get("starting_after", "-1"))
        except ValueError:
            after = -2
        if after < -1:
            raise BadField("starting_after", "starting_after must be an event's sequence number (an integer >= 0).")
        return runs.follow(owner, response_id, after + 1)

    async def cancel(self, owner: str, response_id: str) -> Response:
        """`POST /v1/responses/{id}/cancel`: a background response that is still running."""
        stored = await self._stored(owner, response_id)
        runs = self.background
        outcome = "" if runs is None else await runs.cancel(owner, response_id, stored)
        if outcome == "":
            raise BadField("response_id", "Only a background response can be cancelled.")
        if isinstance(outcome, str):
            raise BadField("response_id", f"Cannot cancel a response whose status is {outcome}.")
        return JSONResponse(response_view(outcome, NONE))

    async def delete(self, owner: str, response_id: str) -> Response:
        kept = self.store
        if kept is None or not await self._call(lambda: kept.delete(owner, response_id)):
            raise ResponseNotFound(response_id)
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    async def list_input_items(self, owner: str, response_id: str, request: Request) -> Response:
        includes = query_includes(request)
        items = (await self._stored(owner, response_id)).input_items
        by_id = {item.get("id"): item for item in items}
        chosen, more = page([item.get("id") for item in items], request, "input item", "this response")
        return JSONResponse(list_body(items_view([by_id[i] for i in chosen], includes), more))


def query_includes(request: Request) -> frozenset[str]:
    """A read's `include` query parameter (`include[]` as the OpenAI SDK sends it; repeated for
    several values): the values it honours (recipe_bridge/includes.py), 400 for any other."""
    params = request.query_params
    values = params.getlist("include") + params.getlist("include[]")
    return includes_of(values) if values else NONE


def page(ids: list[Any], request: Request, what: str, where: str) -> tuple[list[Any], bool]:
    """A page of an OpenAI list (`ids` oldest first) by the request's `after`, `limit` and
    `order` (default desc): its ids, and whether more follow."""
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
    ordered = ids[::-1] if order == "desc" else ids
    after = params.get("after")
    if after is not None:
        if after not in ordered:
            raise BadField("after", f"No {what} with id '{after}' in {where}.")
        ordered = ordered[ordered.index(after) + 1:]
    return ordered[:limit], len(ordered) > limit


def list_body(data: list[dict[str, Any]], more: bool) -> dict[str, Any]:
    """An OpenAI list object of `data`, each with an `id`."""
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": more}


def _replayable(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A stored response's output items as the next request's input: its messages, tool calls and
    their results, without logprobs. Reasoning is left out: the chat template drops an earlier
    turn's reasoning."""
    return [replayable(item) for item in output if item.get("type") != "reasoning"]


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


async def _nothing() -> None:
    return None


_ECHOED = ("instructions", "max_output_tokens", "metadata", "model", "parallel_tool_calls", "previous_response_id",
           "reasoning", "temperature", "text", "tool_choice", "tools", "top_logprobs", "top_p", "truncation", "user")


def queued_response(obj: dict[str, Any], response_id: str, conversation: str | None) -> dict[str, Any]:
    """A background response's object before it runs: what the request asked, status queued."""
    response: dict[str, Any] = {"id": response_id, "object": "response", "created_at": int(time.time()),
                                "status": "queued", "background": True, "error": None, "incomplete_details": None,
                                "output": [], "usage": None, "store": True, "metadata": {}, "tools": [],
                                "parallel_tool_calls": True, "tool_choice": "auto"}
    response.update({name: obj[name] for name in _ECHOED if obj.get(name) is not None})
    if conversation is not None:
        response["conversation"] = {"id": conversation}
    return response


def _said(pending: Pending, stored: bool) -> dict[str, Any]:
    """The response object's fields that say whether it was stored and in which conversation."""
    if pending.conversation is None:
        return {"store": stored}
    return {"store": stored, "conversation": {"id": pending.conversation}}


def _with_fields(chunk: bytes, fields: dict[str, Any]) -> bytes:
    """An SSE chunk with `fields` set in each response object it carries."""
    lines = chunk.split(b"\n")
    for i, line in enumerate(lines):
        if line.startswith(b"data: ") and b'"store"' in line:
            try:
                event = orjson.loads(line[6:])
            except orjson.JSONDecodeError:
                continue
            response = event.get("response") if isinstance(event, dict) else None
            if isinstance(response, dict):
                response.update(fields)
                lines[i] = b"data: " + orjson.dumps(event)
    return b"\n".join(lines)
