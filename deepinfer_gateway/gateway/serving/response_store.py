"""Stored Responses (`store: true`): each answered response with the input it answered, per API key.

What is kept per response: the response object as the client received it, and the whole
input it answered (earlier turns included, as input items with ids), so that
`previous_response_id` continues the conversation and `GET .../input_items` lists it.
A key sees only its own responses (another key's id is "not found"); each key holds at
most `max_per_key` live responses (a put beyond that is refused), each at most `max_bytes`.

Two stores behind one interface: this process's memory (lost with it), or Redis, where the
responses are durable state (docs/deploy.md: they live as long as Redis keeps its data).
Redis layout, one hash slot per key (the hash tag): `{dgw:resp:<owner>}:<id>` holds the
serialized record with the TTL; the sorted set `{dgw:resp:<owner>}` holds the ids scored by
expiry, for the per-key count.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Protocol

import orjson
from redis import asyncio as aioredis

from deepinfer_gateway.errors import GatewayError


class StoreFull(GatewayError):
    status_code = 400

    def __init__(self, message: str, *, code: str):
        super().__init__(message, param="store", code=code)


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
    ttl_s: int

    async def put(self, owner: str, response_id: str, stored: StoredResponse) -> None:
        """Keep it for `ttl_s`; StoreFull when the owner holds `max_per_key` or it is too large."""

    async def check_room(self, owner: str) -> None:
        """StoreFull when the owner holds `max_per_key` live responses (checked before generating)."""

    async def get(self, owner: str, response_id: str) -> StoredResponse | None: ...

    async def delete(self, owner: str, response_id: str) -> bool: ...


def _check_size(data: bytes, max_bytes: int) -> None:
    if len(data) > max_bytes:
        raise StoreFull(f"The response and its input are {len(data)} bytes, over the {max_bytes}-byte limit of "
                        "a stored response; send store: false.", code="response_too_large")


def _full(max_per_key: int) -> StoreFull:
    return StoreFull(f"This API key holds {max_per_key} stored responses, the limit; delete some "
                     "(DELETE /v1/responses/{id}) or send store: false.", code="stored_responses_limit")


class MemoryResponseStore:
    """This process's memory: lost when it stops."""

    def __init__(self, ttl_s: int, max_per_key: int, max_bytes: int):
        self.ttl_s, self.max_per_key, self.max_bytes = ttl_s, max_per_key, max_bytes
        self._owners: dict[str, OrderedDict[str, tuple[float, bytes]]] = {}

    def _live(self, owner: str) -> OrderedDict[str, tuple[float, bytes]]:
        items = self._owners.setdefault(owner, OrderedDict())
        now = time.monotonic()
        for response_id in [k for k, (expires, _) in items.items() if expires <= now]:
            del items[response_id]
        return items

    async def check_room(self, owner: str) -> None:
        if len(self._live(owner)) >= self.max_per_key:
            raise _full(self.max_per_key)

    async def put(self, owner: str, response_id: str, stored: StoredResponse) -> None:
        data = stored.dumps()
        _check_size(data, self.max_bytes)
        items = self._live(owner)  # the count was checked before generating (check_room)
        items[response_id] = (time.monotonic() + self.ttl_s, data)

    async def get(self, owner: str, response_id: str) -> StoredResponse | None:
        found = self._live(owner).get(response_id)
        return StoredResponse.loads(found[1]) if found else None

    async def delete(self, owner: str, response_id: str) -> bool:
        return self._live(owner).pop(response_id, None) is not None


class RedisResponseStore:
    """Redis (durable where Redis keeps its data); an outage fails the call (the caller answers 5xx)."""

    def __init__(self, redis: aioredis.Redis, ttl_s: int, max_per_key: int, max_bytes: int):
        self.redis = redis
        self.ttl_s, self.max_per_key, self.max_bytes = ttl_s, max_per_key, max_bytes

    @staticmethod
    def _keys(owner: str, response_id: str) -> tuple[str, str]:
        tag = "{dgw:resp:" + hashlib.sha256(owner.encode()).hexdigest()[:32] + "}"
        return tag, f"{tag}:{response_id}"

    async def _count(self, index: str) -> int:
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.zremrangebyscore(index, "-inf", time.time())
            pipe.zcard(index)
            _, count = await pipe.execute()
        return int(count)

    async def check_room(self, owner: str) -> None:
        if await self._count(self._keys(owner, "")[0]) >= self.max_per_key:
            raise _full(self.max_per_key)

    async def put(self, owner: str, response_id: str, stored: StoredResponse) -> None:
        """The count was checked before the response was generated (`check_room`): a put that
        races past the limit by a few is kept rather than lose an answered response."""
        data = stored.dumps()
        _check_size(data, self.max_bytes)
        index, key = self._keys(owner, response_id)
        now = time.time()
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.set(key, data, ex=self.ttl_s)
            pipe.zadd(index, {response_id: now + self.ttl_s})
            pipe.expire(index, self.ttl_s)
            await pipe.execute()

    async def get(self, owner: str, response_id: str) -> StoredResponse | None:
        data = await self.redis.get(self._keys(owner, response_id)[1])
        return StoredResponse.loads(data) if data is not None else None

    async def delete(self, owner: str, response_id: str) -> bool:
        index, key = self._keys(owner, response_id)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.delete(key)
            pipe.zrem(index, response_id)
            deleted, _ = await pipe.execute()
        return bool(deleted)
