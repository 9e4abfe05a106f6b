"""Stored Responses (`store: true`): each answered response with the input it answered, per owner.

The owner is the API key's scope (`ApiKey.scope`: its tenant, else the key itself by digest),
never its name. What is kept per response: the response object as the client received it,
and the whole input it answered (earlier turns included, as input items with ids), so that
`previous_response_id` continues the conversation and `GET .../input_items` lists it. An
owner sees only its own responses (another owner's id is "not found").

Bounds (`Quota`): each owner holds at most `max_per_key` live responses and `max_bytes_per_key`
bytes (beyond either, `store: true` is refused: 400 `StoreFull`, which the client can fix by
deleting some), each response at most `max_bytes`; all owners together at most
`max_total_bytes` (beyond it `StoreExhausted`: the caller serves the response unstored, as
no client can fix it). A put that comes after the room was checked may still find it gone
(`put` raises then; the answer already went out).

Two stores behind one interface: this process's memory (lost with it), or Redis, where the
responses are durable state (docs/deploy.md). In Redis nothing of it carries a TTL: Redis's
shipped `volatile-lru` policy evicts only keys with one, and a stored response is state a
client was promised, not a cache; expiry is the gateway's (an expired response is never
served, and is deleted by the next write, oldest first) and the total is bounded by
`max_total_bytes`, expired ones included, so Redis's `maxmemory` can be sized for it.
Layout, all under one hash tag (one slot, so one script sees the whole budget):

- `{dgw:resp}:r:<owner>:<id>`: the serialized record.
- `{dgw:resp}:ids:<owner>`: sorted set, the owner's ids scored by expiry (count, ownership).
- `{dgw:resp}:exp`: sorted set, `<owner>:<id>` by expiry, for all owners (what to delete first).
- `{dgw:resp}:size`: hash, `<owner>:<id>` -> bytes.
- `{dgw:resp}:bytes`: hash, `<owner>` -> bytes held, `*` -> all owners' bytes.
- `{dgw:resp}:bg:<owner>:<id>`, `{dgw:resp}:ev:<owner>:<id>`: a background response's run state
  and events (background_store.py), deleted with its record.

`<owner>` is 32 hex digits of the scope's SHA-256.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Protocol

import orjson
from redis import asyncio as aioredis

from deepinfer_gateway.core.errors import GatewayError


class StoreFull(GatewayError):
    status_code = 400

    def __init__(self, message: str, *, code: str):
        super().__init__(message, param="store", code=code)


class StoreExhausted(Exception):
    """All owners' stored responses fill `max_total_bytes`: this one is served, not stored."""


@dataclass(frozen=True, slots=True)
class Quota:
    ttl_s: int
    max_per_key: int
    max_bytes: int
    max_bytes_per_key: int
    max_total_bytes: int


@dataclass(frozen=True, slots=True)
class StoredResponse:
    response: dict[str, Any]  # the response object as answered
    input_items: list[dict[str, Any]]  # the whole input it answered, earlier turns included

    def dumps(self) -> bytes:
        return orjson.dumps({"response": self.response, "input_items": self.input_items})

    @classmethod
    def loads(cls, data: bytes | str) -> StoredResponse:
        obj = orjson.loads(data)
        return cls(obj["response"], obj["input_items"])


class ResponseStore(Protocol):
    quota: Quota

    async def put(self, owner: str, response_id: str, stored: StoredResponse) -> None:
        """Keep it for `ttl_s`; StoreFull (too large, the owner's bytes) or StoreExhausted."""

    async def check_room(self, owner: str, size: int) -> None:
        """Before generating, with `size` a lower bound of the record's: StoreFull when the owner
        is at its count or the size would take it past its bytes, StoreExhausted when past
        `max_total_bytes`."""

    async def get(self, owner: str, response_id: str) -> StoredResponse | None: ...

    async def delete(self, owner: str, response_id: str) -> bool: ...


def _check_size(data: bytes, quota: Quota) -> None:
    if len(data) > quota.max_bytes:
        raise StoreFull(f"The response and its input are {len(data)} bytes, over the {quota.max_bytes}-byte limit "
                        "of a stored response; send store: false.", code="response_too_large")


def _refusal(verdict: int, quota: Quota) -> Exception | None:
    """The exception for a room check's verdict (0: room)."""
    if verdict == 1:
        return StoreFull(f"This API key holds {quota.max_per_key} stored responses, the limit; delete some "
                         "(DELETE /v1/responses/{id}) or send store: false.", code="stored_responses_limit")
    if verdict == 2:
        return StoreFull(f"This API key's stored responses fill its {quota.max_bytes_per_key} bytes; delete some "
                         "(DELETE /v1/responses/{id}) or send store: false.", code="stored_bytes_limit")
    if verdict == 3:
        return StoreExhausted(f"stored responses fill responses.max_total_bytes ({quota.max_total_bytes})")
    return None


def owner_hash(owner: str) -> str:
    return hashlib.sha256(owner.encode()).hexdigest()[:32]


class MemoryResponseStore:
    """This process's memory: lost when it stops."""

    def __init__(self, quota: Quota):
        self.quota = quota
        self._owners: dict[str, OrderedDict[str, tuple[float, bytes]]] = {}
        self._bytes: dict[str, int] = {}
        self._total = 0

    def _live(self, owner: str) -> OrderedDict[str, tuple[float, bytes]]:
        items = self._owners.setdefault(owner, OrderedDict())
        now = time.monotonic()
        for response_id in [k for k, (expires, _) in items.items() if expires <= now]:
            self._drop(owner, items, response_id)
        return items

    def _drop(self, owner: str, items: OrderedDict[str, tuple[float, bytes]], response_id: str) -> bool:
        found = items.pop(response_id, None)
        if found is None:
            return False
        self._bytes[owner] -= len(found[1])
        self._total -= len(found[1])
        return True

    def _verdict(self, owner: str, size: int, count: int) -> int:
        if count >= self.quota.max_per_key:
            return 1
        if self._bytes.get(owner, 0) + size > self.quota.max_bytes_per_key:
            return 2
        return 3 if self._total + size > self.quota.max_total_bytes else 0

    async def check_room(self, owner: str, size: int) -> None:
        refused = _refusal(self._verdict(owner, size, len(self._live(owner))), self.quota)
        if refused is not None:
            raise refused

    async def put(self, owner: str, response_id: str, stored: StoredResponse) -> None:
        data = stored.dumps()
        _check_size(data, self.quota)
        items = self._live(owner)
        self._drop(owner, items, response_id)  # replaced (a background response's record as it runs)
        refused = _refusal(self._verdict(owner, len(data), 0), self.quota)  # the count was checked before
        if refused is not None:
            raise refused
        items[response_id] = (time.monotonic() + self.quota.ttl_s, data)
        self._bytes[owner] = self._bytes.get(owner, 0) + len(data)
        self._total += len(data)

    async def get(self, owner: str, response_id: str) -> StoredResponse | None:
        found = self._live(owner).get(response_id)
        return StoredResponse.loads(found[1]) if found else None

    async def delete(self, owner: str, response_id: str) -> bool:
        return self._drop(owner, self._live(owner), response_id)


TAG = "{dgw:resp}"
EXPIRY_KEY, SIZE_KEY, BYTES_KEY = f"{TAG}:exp", f"{TAG}:size", f"{TAG}:bytes"
_PURGE_BATCH = 64  # expired responses deleted per write: bounded work, ahead of the rate they expire

# KEYS: exp, size, bytes, ids:<owner>; ARGV[1] now, ARGV[2] owner. Every key a script touches is
# under TAG (one slot); the records' keys are built here from the members.
_PRELUDE = """
local exp, size_key, bytes_key, ids = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local now, owner = tonumber(ARGV[1]), ARGV[2]
local tag = string.sub(exp, 1, #exp - 4)
local function drop(member)
  local o, id = string.match(member, '^([^:]+):(.*)$')
  local size = tonumber(redis.call('HGET', size_key, member) or '0')
  redis.call('DEL', tag .. ':r:' .. member, tag .. ':bg:' .. member, tag .. ':ev:' .. member)
  redis.call('ZREM', tag .. ':ids:' .. o, id)
  redis.call('ZREM', exp, member)
  redis.call('HDEL', size_key, member)
  if size > 0 then
    redis.call('HINCRBY', bytes_key, o, -size)
    redis.call('HINCRBY', bytes_key, '*', -size)
  end
end
local function purge()
  for _, member in ipairs(redis.call('ZRANGEBYSCORE', exp, '-inf', now, 'LIMIT', 0, BATCH)) do drop(member) end
  for _, id in ipairs(redis.call('ZRANGEBYSCORE', ids, '-inf', now, 'LIMIT', 0, BATCH)) do drop(owner .. ':' .. id) end
end
-- 0: room; 1: the owner's count; 2: the owner's bytes; 3: all owners' bytes
local function verdict(size, max_count, max_owner, max_total)
  if max_count > 0 and redis.call('ZCARD', ids) >= max_count then return 1 end
  if tonumber(redis.call('HGET', bytes_key, owner) or '0') + size > max_owner then return 2 end
  if tonumber(redis.call('HGET', bytes_key, '*') or '0') + size > max_total then return 3 end
  return 0
end
-- Keep `data` as the owner's record `id` until `expires`, in place of one there; the verdict (0:
-- kept). A max_count of 0 leaves the count unchecked.
local function keep(id, data, expires, max_count, max_owner, max_total)
  local member = owner .. ':' .. id
  if redis.call('HEXISTS', size_key, member) == 1 then drop(member) end
  local refused = verdict(#data, max_count, max_owner, max_total)
  if refused ~= 0 then return refused end
  redis.call('SET', tag .. ':r:' .. member, data)
  redis.call('ZADD', ids, expires, id)
  redis.call('ZADD', exp, expires, member)
  redis.call('HSET', size_key, member, #data)
  redis.call('HINCRBY', bytes_key, owner, #data)
  redis.call('HINCRBY', bytes_key, '*', #data)
  return 0
end
""".replace("BATCH", str(_PURGE_BATCH))

# ARGV[3..5]: max_per_key, max_bytes_per_key, max_total_bytes; ARGV[6]: the record's size at least
_ROOM = _PRELUDE + """
purge()
return verdict(tonumber(ARGV[6]), tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5]))
"""

# ARGV[3..5] as _ROOM (the count is not checked again: it was before generating, and a put that
# races past it by a few is kept rather than lose an answered response); ARGV[6] id, ARGV[7] the
# record, ARGV[8] its expiry.
_PUT = _PRELUDE + """
purge()
return keep(ARGV[6], ARGV[7], tonumber(ARGV[8]), 0, tonumber(ARGV[4]), tonumber(ARGV[5]))
"""

# ARGV[3]: id. 1 when a live response was deleted.
_DELETE = _PRELUDE + """
local score = redis.call('ZSCORE', ids, ARGV[3])
if not score then return 0 end
drop(owner .. ':' .. ARGV[3])
if tonumber(score) <= now then return 0 end
return 1
"""


class RedisResponseStore:
    """Redis (durable where Redis keeps its data); an outage raises redis' errors (the caller degrades)."""

    def __init__(self, redis: aioredis.Redis, quota: Quota):
        self.redis = redis
        self.quota = quota
        self._room = redis.register_script(_ROOM)
        self._put = redis.register_script(_PUT)
        self._delete = redis.register_script(_DELETE)

    def _keys(self, owner: str) -> tuple[str, list[str]]:
        digest = owner_hash(owner)
        return digest, [EXPIRY_KEY, SIZE_KEY, BYTES_KEY, f"{TAG}:ids:{digest}"]

    def _limits(self) -> list[int]:
        return [self.quota.max_per_key, self.quota.max_bytes_per_key, self.quota.max_total_bytes]

    async def check_room(self, owner: str, size: int) -> None:
        digest, keys = self._keys(owner)
        verdict = await self._room(keys=keys, args=[time.time(), digest, *self._limits(), size])
        refused = _refusal(int(verdict), self.quota)
        if refused is not None:
            raise refused

    async def put(self, owner: str, response_id: str, stored: StoredResponse) -> None:
        data = stored.dumps()
        _check_size(data, self.quota)
        digest, keys = self._keys(owner)
        now = time.time()
        verdict = await self._put(keys=keys, args=[now, digest, *self._limits(), response_id, data,
                                                   now + self.quota.ttl_s])
        refused = _refusal(int(verdict), self.quota)
        if refused is not None:
            raise refused

    async def get(self, owner: str, response_id: str) -> StoredResponse | None:
        digest, keys = self._keys(owner)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.zscore(keys[3], response_id)
            pipe.get(f"{TAG}:r:{digest}:{response_id}")
            expires, data = await pipe.execute()
        if expires is None or float(expires) <= time.time() or data is None:
            return None  # unknown, another owner's, or expired (deleted by a later write)
        return StoredResponse.loads(data)

    async def delete(self, owner: str, response_id: str) -> bool:
        digest, keys = self._keys(owner)
        return bool(await self._delete(keys=keys, args=[time.time(), digest, response_id]))
