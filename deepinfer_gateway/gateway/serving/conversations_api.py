"""The Conversations API over a `ConversationStore` (conversation_store.py), as OpenAI's:

- `POST /v1/conversations` (`items`: at most 20 first items, `metadata`), `GET`, `POST`
  (new `metadata`) and `DELETE /v1/conversations/{id}`;
- `GET /v1/conversations/{id}/items` (`after`, `limit`, `order`), `POST .../items` (`items`: at
  most 20), `GET` and `DELETE .../items/{item_id}` (the delete answers the conversation);
- `conversation` on a Responses request (responses_api.py): its items come before the new
  input, and the new input and the output are appended once the response is answered.

Items are Responses input/output items, each with an id (one is given to an item sent
without). The item routes' `include` shows what a stored item holds beyond the default
(recipe_bridge/includes.py): an answer's logprobs, input images' URLs. What needs the store
answers 503 `store_unavailable` with `Retry-After` while it fails (a Redis outage), like
stored Responses; another key's conversation is 404.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from deepinfer_gateway.core.errors import GatewayError
from deepinfer_gateway.core.outage import Outage
from deepinfer_gateway.gateway.serving.conversation_store import ConversationStore
from deepinfer_gateway.gateway.serving.responses_api import (
    BadField,
    input_items,
    list_body,
    page,
    query_includes,
    through_outage,
)
from deepinfer_gateway.recipe_bridge.includes import item_view, items_view

T = TypeVar("T")

MAX_ITEMS_PER_REQUEST = 20  # OpenAI's, for `items` of a create and of an items create
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512


class ConversationNotFound(GatewayError):
    status_code = 404

    def __init__(self, conversation_id: str, param: str | None = None):
        super().__init__(f"Conversation with id '{conversation_id}' not found.", param=param, code="not_found")


class ItemNotFound(GatewayError):
    status_code = 404

    def __init__(self, item_id: str):
        super().__init__(f"Item with id '{item_id}' not found.", code="not_found")


def metadata(value: Any) -> dict[str, str]:
    """OpenAI's metadata: at most 16 string pairs, keys up to 64 and values up to 512 characters."""
    if value is None:
        return {}
    if not isinstance(value, dict) or len(value) > MAX_METADATA_PAIRS or not all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= MAX_METADATA_KEY and len(v) <= MAX_METADATA_VALUE
            for k, v in value.items()):
        raise BadField("metadata", f"metadata must be an object of at most {MAX_METADATA_PAIRS} string values, keys "
                                   f"up to {MAX_METADATA_KEY} and values up to {MAX_METADATA_VALUE} characters.")
    return dict(value)


def conversation_items(value: Any) -> list[dict[str, Any]]:
    """`items` of a request: Responses input items, each with an id and a type."""
    if value is None:
        return []
    if not isinstance(value, list) or len(value) > MAX_ITEMS_PER_REQUEST:
        raise BadField("items", f"items must be a list of at most {MAX_ITEMS_PER_REQUEST} items.")
    items = input_items(value)
    for item in items:
        if not isinstance(item.get("type"), str) or not isinstance(item["id"], str) or not item["id"]:
            raise BadField("items", "each item needs a type (or a role, for a message) and a string id.")
        if item["type"] == "message":
            item.setdefault("status", "completed")
    return items


def conversation_id_of(value: Any) -> str:
    """A Responses request's `conversation`: its id, or an object with one."""
    if isinstance(value, dict):
        value = value.get("id")
    if not isinstance(value, str) or not value:
        raise BadField("conversation", "conversation must be a conversation id or an object with its id.")
    return value


def _body(raw: bytes, allowed: set[str]) -> dict[str, Any]:
    try:
        body = orjson.loads(raw) if raw.strip() else {}
    except orjson.JSONDecodeError:
        raise BadField("body", "The body is not valid JSON.") from None
    if not isinstance(body, dict):
        raise BadField("body", "The body must be a JSON object.")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise BadField(unknown[0], f"Unknown parameter: '{unknown[0]}'.")
    return body


class ConversationsState:
    def __init__(self, store: ConversationStore | None, on_error: Callable[[], None] = lambda: None):
        self.store = store  # None: conversations are off (conversations.enabled)
        self._outage = Outage("conversations", "the Conversations API answers 503", on_error)

    async def _call(self, operation: Callable[[ConversationStore], Awaitable[T]]) -> T:
        """Run a store operation; StoreUnavailable when it fails (or is known to be failing)."""
        store = self.store
        if store is None:
            raise GatewayError("The Conversations API is turned off on this gateway (conversations.enabled).",
                               status_code=404, code="not_found")
        return await through_outage(self._outage, lambda: operation(store))

    async def _conversation(self, owner: str, conversation_id: str) -> dict[str, Any]:
        found = await self._call(lambda s: s.get(owner, conversation_id))
        if found is None:
            raise ConversationNotFound(conversation_id)
        return found

    # --- for Responses (responses_api.py) ------------------------------------------------------
    async def context(self, owner: str, conversation: Any, new: list[dict[str, Any]]
                      ) -> tuple[str, list[dict[str, Any]]]:
        """A Responses request's `conversation`: its id and its items, to come before the new
        input `new`; 404 (param `conversation`) when it does not exist, 400 when the new input
        and an answer would pass its bound or an input item's id is already in it (the append
        after the answer would be refused)."""
        conversation_id = conversation_id_of(conversation)
        items = await self._call(lambda s: s.items(owner, conversation_id))
        if items is None:
            raise ConversationNotFound(conversation_id, "conversation")
        assert self.store is not None
        held = {item.get("id") for item in items}
        repeated = next((item["id"] for item in new if item.get("id") in held), None)
        if repeated is not None:
            raise BadField("input", f"An item with id '{repeated}' is already in the conversation; send only the new "
                                    "input.")
        adding = len(new) + 1  # and at least one output item
        if len(items) + adding > self.store.quota.max_items:
            raise BadField("conversation", f"The conversation holds {len(items)} items; with this response's it would "
                                           f"pass its limit of {self.store.quota.max_items}; start a new one.")
        return conversation_id, items

    async def append(self, owner: str, conversation_id: str, items: list[dict[str, Any]]) -> None:
        """A response's new input and output items, appended (raises what the store raises)."""
        await self._call(lambda s: s.add_items(owner, conversation_id, items))

    # --- the routes -------------------------------------------------------------------------
    async def create(self, owner: str, raw: bytes) -> Response:
        body = _body(raw, {"items", "metadata"})
        conversation = {"id": f"conv_{uuid.uuid4().hex}{uuid.uuid4().hex[:16]}", "object": "conversation",
                        "created_at": int(time.time()), "metadata": metadata(body.get("metadata"))}
        items = conversation_items(body.get("items"))
        await self._call(lambda s: s.create(owner, conversation, items))
        return JSONResponse(conversation)

    async def retrieve(self, owner: str, conversation_id: str) -> Response:
        return JSONResponse(await self._conversation(owner, conversation_id))

    async def update(self, owner: str, conversation_id: str, raw: bytes) -> Response:
        body = _body(raw, {"metadata"})
        if "metadata" not in body:
            raise BadField("metadata", "Missing required parameter: 'metadata'.")
        conversation = {**await self._conversation(owner, conversation_id), "metadata": metadata(body["metadata"])}
        if not await self._call(lambda s: s.update(owner, conversation)):
            raise ConversationNotFound(conversation_id)
        return JSONResponse(conversation)

    async def delete(self, owner: str, conversation_id: str) -> Response:
        if not await self._call(lambda s: s.delete(owner, conversation_id)):
            raise ConversationNotFound(conversation_id)
        return JSONResponse({"id": conversation_id, "object": "conversation.deleted", "deleted": True})

    async def list_items(self, owner: str, conversation_id: str, request: Request) -> Response:
        includes = query_includes(request)
        ids = await self._call(lambda s: s.item_ids(owner, conversation_id))
        if ids is None:
            raise ConversationNotFound(conversation_id)
        chosen, more = page(ids, request, "item", "this conversation")  # only the page's items are read
        items = await self._call(lambda s: s.items_by_id(owner, conversation_id, chosen))
        return JSONResponse(list_body(items_view(items, includes), more))

    async def add_items(self, owner: str, conversation_id: str, request: Request, raw: bytes) -> Response:
        includes = query_includes(request)
        body = _body(raw, {"items"})
        items = conversation_items(body.get("items"))
        if not items:
            raise BadField("items", "items must hold at least one item.")
        if not await self._call(lambda s: s.add_items(owner, conversation_id, items)):
            raise ConversationNotFound(conversation_id)
        return JSONResponse({"object": "list", "data": items_view(items, includes), "first_id": items[0]["id"],
                             "last_id": items[-1]["id"], "has_more": False})

    async def retrieve_item(self, owner: str, conversation_id: str, item_id: str, request: Request) -> Response:
        includes = query_includes(request)
        ids = await self._call(lambda s: s.item_ids(owner, conversation_id))
        if ids is None:
            raise ConversationNotFound(conversation_id)
        found = await self._call(lambda s: s.items_by_id(owner, conversation_id, [item_id])) if item_id in ids else []
        if not found:
            raise ItemNotFound(item_id)
        return JSONResponse(item_view(found[0], includes))

    async def delete_item(self, owner: str, conversation_id: str, item_id: str) -> Response:
        deleted = await self._call(lambda s: s.delete_item(owner, conversation_id, item_id))
        if deleted is None:
            raise ConversationNotFound(conversation_id)
        if not deleted:
            raise ItemNotFound(item_id)
        return JSONResponse(await self._conversation(owner, conversation_id))
