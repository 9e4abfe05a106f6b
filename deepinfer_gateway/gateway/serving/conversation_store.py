"""Conversations (the Conversations API): a conversation's metadata and its items, per owner.

The owner is the API key's scope (`ApiKey.scope`), as for stored Responses (response_store.py,
whose design this follows): another owner's conversation is "not found". A conversation is
kept until its owner deletes it (OpenAI's conversations do not expire either), so the bounds
are what keeps the store finite (`ConversationQuota`): each owner holds at most `max_per_key`
conversations and `max_bytes_per_key` bytes, each conversation at most `max_items` items, all
owners together `max_total_bytes`. Past a bound a write is refused as a whole (nothing of it
is kept).

Two stores behind one interface: this process's memory (lost with it), or Redis, where the
conversations are durable state (docs/deploy.md): no key carries a TTL (Redis's shipped
`volatile-lru` evicts only keys with one), every update is one Lua script, and every key is
under one hash tag (one slot: one script sees the whole budget). Layout (`<owner>`: 32 hex
digits of the scope's SHA-256):

- `{dgw:conv}:c:<owner>:<id>`: hash, `obj` (the conversation object), `seq` (the last item's
  position), `bytes` (the conversation's bytes, its items included).
- `{dgw:conv}:i:<owner>:<id>`: hash, item id -> the item.
- `{dgw:conv}:o:<owner>:<id>`: sorted set, item ids by position (their order).
- `{dgw:conv}:ids:<owner>`: sorted set, the owner's conversation ids by creation (its count).
- `{dgw:conv}:bytes`: hash, `<owner>` -> bytes held, `*` -> all owners' bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson
from redis import asyncio as aioredis

from deepinfer_gateway.core.errors import GatewayError
from deepinfer_gateway.gateway.serving.response_store import owner_hash


@dataclass(frozen=True, slots=True)
class ConversationQuota:
    max_per_key: int
    max_items: int
    max_bytes_per_key: int
    max_total_bytes: int


class ConversationFull(GatewayError):
    """A bound the owner can fix (delete conversations or items): 400."""

    status_code = 400

    def __init__(self, message: str, *, code: str):
        super().__init__(message, code=code)


class ConversationsExhausted(GatewayError):
    """All owners' conversations fill `max_total_bytes`: no client can fix it."""

    status_code = 503

    def __init__(self, quota: ConversationQuota):
        super().__init__(f"This gateway's conversations fill conversations.max_total_bytes "
                         f"({quota.max_total_bytes}); nothing more can be stored until some are deleted.",
                         code="conversation_store_full")


class DuplicateItem(GatewayError):
    status_code = 400

    def __init__(self, item_id: str):
        super().__init__(f"An item with id '{item_id}' is already in this conversation.", param="items",
                         code="invalid_request_error")


# Verdicts of a write (the Lua scripts' and the memory store's).
OK, NOT_FOUND, COUNT, BYTES, TOTAL, ITEMS, DUPLICATE = 0, -1, 1, 2, 3, 4, 5


def _raise_for(verdict: int, quota: ConversationQuota, detail: str = "") -> bool:
    """False for NOT_FOUND, True for OK; else the refusal."""
    if verdict == OK:
        return True
    if verdict == NOT_FOUND:
        return False
    if verdict == COUNT:
        raise ConversationFull(f"This API key holds {quota.max_per_key} conversations, the limit; delete some "
                               "(DELETE /v1/conversations/{id}).", code="conversations_limit")
    if verdict == BYTES:
        raise ConversationFull(f"This API key's conversations fill its {quota.max_bytes_per_key} bytes; delete "
                               "some conversations or items.", code="conversation_bytes_limit")
    if verdict == TOTAL:
        raise ConversationsExhausted(quota)
    if verdict == ITEMS:
        raise ConversationFull(f"A conversation holds at most {quota.max_items} items; delete some "
                               "(DELETE /v1/conversations/{id}/items/{item_id}) or start a new conversation.",
                               code="conversation_items_limit")
    if verdict == DUPLICATE:
        raise DuplicateItem(detail)
    raise RuntimeError(f"unexpected verdict {verdict}")


def _item_pairs(items: list[dict[str, Any]]) -> list[tuple[str, bytes]]:
    return [(str(item["id"]), orjson.dumps(item)) for item in items]


def _duplicate(pairs: list[tuple[str, bytes]], existing: Any) -> str | None:
    seen: set[str] = set()
    for item_id, _ in pairs:
        if item_id in seen or item_id in existing:
            return item_id
        seen.add(item_id)
    return None


class ConversationStore(Protocol):
    quota: ConversationQuota

    async def create(self, owner: str, conversation: dict[str, Any], items: list[dict[str, Any]]) -> None:
        """Keep a new conversation (`conversation["id"]`) with its first items (each with an id)."""

    async def get(self, owner: str, conversation_id: str) -> dict[str, Any] | None: ...

    async def update(self, owner: str, conversation: dict[str, Any]) -> bool:
        """Replace the conversation object (its metadata); False when there is none."""

    async def delete(self, owner: str, conversation_id: str) -> bool: ...

    async def add_items(self, owner: str, conversation_id: str, items: list[dict[str, Any]]) -> bool:
        """Append items in order (all or none); False when the conversation does not exist."""

    async def items(self, owner: str, conversation_id: str) -> list[dict[str, Any]] | None:
        """All its items, oldest first (at most `max_items`); None when it does not exist."""

    async def item_ids(self, owner: str, conversation_id: str) -> list[str] | None:
        """Its items' ids, oldest first; None when it does not exist."""

    async def items_by_id(self, owner: str, conversation_id: str, item_ids: list[str]) -> list[dict[str, Any]]:
        """These items, in this order (one deleted meanwhile left out)."""

    async def delete_item(self, owner: str, conversation_id: str, item_id: str) -> bool | None:
        """None when the conversation does not exist, False when the item does not."""


@dataclass
class _Held:
    obj: bytes
    items: dict[str, bytes] = field(default_factory=dict)  # insertion order is the conversation's

    def size(self) -> int:
        return len(self.obj) + sum(len(v) for v in self.items.values())


class MemoryConversationStore:
    """This process's memory: lost when it stops."""

    def __init__(self, quota: ConversationQuota):
        self.quota = quota
        self._owners: dict[str, dict[str, _Held]] = {}
        self._bytes: dict[str, int] = {}
        self._total = 0

    def _room(self, owner: str, added: int) -> int:
        if self._bytes.get(owner, 0) + added > self.quota.max_bytes_per_key:
            return BYTES
        return TOTAL if self._total + added > self.quota.max_total_bytes else OK

    def _account(self, owner: str, delta: int) -> None:
        self._bytes[owner] = self._bytes.get(owner, 0) + delta
        self._total += delta

    async def create(self, owner: str, conversation: dict[str, Any], items: list[dict[str, Any]]) -> None:
        held = self._owners.setdefault(owner, {})
        pairs = _item_pairs(items)
        obj = orjson.dumps(conversation)
        verdict = COUNT if len(held) >= self.quota.max_per_key else OK
        if verdict == OK and len(pairs) > self.quota.max_items:
            verdict = ITEMS
        duplicate = _duplicate(pairs, ())
        verdict = verdict or (DUPLICATE if duplicate else OK)
        kept = _Held(obj, dict(pairs))
        verdict = verdict or self._room(owner, kept.size())
        _raise_for(verdict, self.quota, duplicate or "")
        held[str(conversation["id"])] = kept
        self._account(owner, kept.size())

    async def get(self, owner: str, conversation_id: str) -> dict[str, Any] | None:
        kept = self._owners.get(owner, {}).get(conversation_id)
        return None if kept is None else orjson.loads(kept.obj)

    async def update(self, owner: str, conversation: dict[str, Any]) -> bool:
        kept = self._owners.get(owner, {}).get(str(conversation["id"]))
        if kept is None:
            return False
        obj = orjson.dumps(conversation)
        delta = len(obj) - len(kept.obj)
        _raise_for(self._room(owner, delta) if delta > 0 else OK, self.quota)
        kept.obj = obj
        self._account(owner, delta)
        return True

    async def delete(self, owner: str, conversation_id: str) -> bool:
        kept = self._owners.get(owner, {}).pop(conversation_id, None)
        if kept is None:
            return False
        self._account(owner, -kept.size())
        return True

    async def add_items(self, owner: str, conversation_id: str, items: list[dict[str, Any]]) -> bool:
        kept = self._owners.get(owner, {}).get(conversation_id)
        if kept is None:
            return False
        pairs = _item_pairs(items)
        duplicate = _duplicate(pairs, kept.items)
        verdict = ITEMS if len(kept.items) + len(pairs) > self.quota.max_items else OK
        verdict = verdict or (DUPLICATE if duplicate else OK)
        added = sum(len(data) for _, data in pairs)
        _raise_for(verdict or self._room(owner, added), self.quota, duplicate or "")
        kept.items.update(pairs)
        self._account(owner, added)
        return True

    async def items(self, owner: str, conversation_id: str) -> list[dict[str, Any]] | None:
        kept = self._owners.get(owner, {}).get(conversation_id)
        return None if kept is None else [orjson.loads(data) for data in kept.items.values()]

    async def item_ids(self, owner: str, conversation_id: str) -> list[str] | None:
        kept = self._owners.get(owner, {}).get(conversation_id)
        return None if kept is None else list(kept.items)

    async def items_by_id(self, owner: str, conversation_id: str, item_ids: list[str]) -> list[dict[str, Any]]:
        kept = self._owners.get(owner, {}).get(conversation_id)
        held = kept.items if kept is not None else {}
        return [orjson.loads(held[item_id]) for item_id in item_ids if item_id in held]

    async def delete_item(self, owner: str, conversation_id: str, item_id: str) -> bool | None:
        kept = self._owners.get(owner, {}).get(conversation_id)
        if kept is None:
            return None
        data = kept.items.pop(item_id, None)
        if data is None:
            return False
        self._account(owner, -len(data))
        return True


TAG = "{dgw:conv}"
BYTES_KEY = f"{TAG}:bytes"

# KEYS: bytes, ids:<owner>, c:<owner>:<id>, i:<owner>:<id>, o:<owner>:<id> (one slot: TAG).
# ARGV[1] owner, ARGV[2] conversation id, ARGV[3..6] max_per_key, max_bytes_per_key,
# max_total_bytes, max_items.
_PRELUDE = """
local bytes_key, ids, conv, items, order = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local owner, id = ARGV[1], ARGV[2]
local max_count, max_owner, max_total, max_items = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5]),
  tonumber(ARGV[6])
local function room(size)
  if tonumber(redis.call('HGET', bytes_key, owner) or '0') + size > max_owner then return 2 end
  if tonumber(redis.call('HGET', bytes_key, '*') or '0') + size > max_total then return 3 end
  return 0
end
local function account(size)
  redis.call('HINCRBY', conv, 'bytes', size)
  redis.call('HINCRBY', bytes_key, owner, size)
  redis.call('HINCRBY', bytes_key, '*', size)
end
-- ARGV[first..]: item id, item pairs. A verdict, or 0 with `size` their bytes.
local function check_items(first, held)
  local size, seen = 0, {}
  if held + (#ARGV - first + 1) / 2 > max_items then return 4, 0 end
  for i = first, #ARGV, 2 do
    if seen[ARGV[i]] or redis.call('HEXISTS', items, ARGV[i]) == 1 then return 5, ARGV[i] end
    seen[ARGV[i]] = true
    size = size + #ARGV[i + 1]
  end
  return 0, size
end
local function append(first)
  for i = first, #ARGV, 2 do
    local seq = redis.call('HINCRBY', conv, 'seq', 1)
    redis.call('HSET', items, ARGV[i], ARGV[i + 1])
    redis.call('ZADD', order, seq, ARGV[i])
  end
end
"""

# ARGV[7] the conversation object, ARGV[8] its creation time, ARGV[9..] items.
_CREATE = _PRELUDE + """
if redis.call('ZCARD', ids) >= max_count then return {1} end
local verdict, size = check_items(9, 0)
if verdict ~= 0 then return {verdict, size} end
size = size + #ARGV[7]
verdict = room(size)
if verdict ~= 0 then return {verdict} end
redis.call('HSET', conv, 'obj', ARGV[7], 'seq', 0, 'bytes', 0)
redis.call('ZADD', ids, tonumber(ARGV[8]), id)
append(9)
account(size)
return {0}
"""

# ARGV[7..]: items.
_ADD = _PRELUDE + """
if redis.call('EXISTS', conv) == 0 then return {-1} end
local verdict, size = check_items(7, redis.call('ZCARD', order))
if verdict ~= 0 then return {verdict, size} end
verdict = room(size)
if verdict ~= 0 then return {verdict} end
append(7)
account(size)
return {0}
"""

# ARGV[7]: the new conversation object.
_UPDATE = _PRELUDE + """
local old = redis.call('HGET', conv, 'obj')
if not old then return {-1} end
local delta = #ARGV[7] - #old
if delta > 0 then
  local verdict = room(delta)
  if verdict ~= 0 then return {verdict} end
end
redis.call('HSET', conv, 'obj', ARGV[7])
account(delta)
return {0}
"""

_DELETE = _PRELUDE + """
local size = redis.call('HGET', conv, 'bytes')
if not size then return {-1} end
redis.call('DEL', conv, items, order)
redis.call('ZREM', ids, id)
redis.call('HINCRBY', bytes_key, owner, -tonumber(size))
redis.call('HINCRBY', bytes_key, '*', -tonumber(size))
return {0}
"""

# ARGV[7]: the item id. {-1}: no conversation, {-2}: no such item.
_DELETE_ITEM = _PRELUDE + """
if redis.call('EXISTS', conv) == 0 then return {-1} end
local data = redis.call('HGET', items, ARGV[7])
if not data then return {-2} end
redis.call('HDEL', items, ARGV[7])
redis.call('ZREM', order, ARGV[7])
account(-#data)
return {0}
"""


class RedisConversationStore:
    """Redis (durable where Redis keeps its data); an outage raises redis' errors (the caller answers 503)."""

    def __init__(self, redis: aioredis.Redis, quota: ConversationQuota):
        self.redis = redis
        self.quota = quota
        self._create = redis.register_script(_CREATE)
        self._add = redis.register_script(_ADD)
        self._update = redis.register_script(_UPDATE)
        self._delete = redis.register_script(_DELETE)
        self._delete_item = redis.register_script(_DELETE_ITEM)

    def _keys(self, owner: str, conversation_id: str) -> tuple[list[str], list[Any]]:
        digest = owner_hash(owner)
        scoped = f"{digest}:{conversation_id}"
        keys = [BYTES_KEY, f"{TAG}:ids:{digest}", f"{TAG}:c:{scoped}", f"{TAG}:i:{scoped}", f"{TAG}:o:{scoped}"]
        q = self.quota
        return keys, [digest, conversation_id, q.max_per_key, q.max_bytes_per_key, q.max_total_bytes, q.max_items]

    @staticmethod
    def _flat(items: list[dict[str, Any]]) -> list[Any]:
        return [part for pair in _item_pairs(items) for part in pair]

    def _verdict(self, reply: list[Any]) -> bool:
        detail = reply[1].decode() if len(reply) > 1 and isinstance(reply[1], bytes) else str(reply[-1])
        return _raise_for(int(reply[0]), self.quota, detail)

    async def create(self, owner: str, conversation: dict[str, Any], items: list[dict[str, Any]]) -> None:
        keys, args = self._keys(owner, str(conversation["id"]))
        reply = await self._create(keys=keys, args=[*args, orjson.dumps(conversation), conversation["created_at"],
                                                    *self._flat(items)])
        self._verdict(reply)

    async def get(self, owner: str, conversation_id: str) -> dict[str, Any] | None:
        keys, _ = self._keys(owner, conversation_id)
        data = await self.redis.hget(keys[2], "obj")
        return None if data is None else orjson.loads(data)

    async def update(self, owner: str, conversation: dict[str, Any]) -> bool:
        keys, args = self._keys(owner, str(conversation["id"]))
        return self._verdict(await self._update(keys=keys, args=[*args, orjson.dumps(conversation)]))

    async def delete(self, owner: str, conversation_id: str) -> bool:
        keys, args = self._keys(owner, conversation_id)
        return self._verdict(await self._delete(keys=keys, args=args))

    async def add_items(self, owner: str, conversation_id: str, items: list[dict[str, Any]]) -> bool:
        keys, args = self._keys(owner, conversation_id)
        return self._verdict(await self._add(keys=keys, args=[*args, *self._flat(items)]))

    async def items(self, owner: str, conversation_id: str) -> list[dict[str, Any]] | None:
        ids = await self.item_ids(owner, conversation_id)
        return None if ids is None else await self.items_by_id(owner, conversation_id, ids)

    async def item_ids(self, owner: str, conversation_id: str) -> list[str] | None:
        keys, _ = self._keys(owner, conversation_id)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.exists(keys[2])
            pipe.zrangebyscore(keys[4], "-inf", "+inf")
            exists, ids = await pipe.execute()
        return [i.decode() if isinstance(i, bytes) else i for i in ids] if exists else None

    async def items_by_id(self, owner: str, conversation_id: str, item_ids: list[str]) -> list[dict[str, Any]]:
        if not item_ids:
            return []
        keys, _ = self._keys(owner, conversation_id)
        found = await self.redis.hmget(keys[3], item_ids)
        return [orjson.loads(data) for data in found if data is not None]  # one deleted meanwhile: gone

    async def delete_item(self, owner: str, conversation_id: str, item_id: str) -> bool | None:
        keys, args = self._keys(owner, conversation_id)
        verdict = int((await self._delete_item(keys=keys, args=[*args, item_id]))[0])
        return None if verdict == NOT_FOUND else verdict == OK
