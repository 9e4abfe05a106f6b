"""API keys kept in Redis (`api_keys_in_redis`): the lookup cache is bounded, and while Redis
fails a key seen before keeps working, an unknown key is refused, and nobody waits for Redis."""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import time

import pytest
import redis.asyncio as aioredis

from deepinfer_gateway.gateway.serving.auth import KeyStore, KeysUnavailable
from deepinfer_gateway.infra.redis_conn import redis_client
from tests.conftest import RedisServer


async def store_key(client: aioredis.Redis, key: str, name: str) -> None:
    await client.hset(f"dgw:apikey:{hashlib.sha256(key.encode()).hexdigest()}", mapping={"name": name})


async def test_the_lookup_cache_keeps_at_most_its_size(redis_url: str) -> None:
    client = redis_client(redis_url)
    await store_key(client, "kept-key", "kept")
    keys = KeyStore((), client, cache_size=4)
    try:
        for i in range(50):  # random keys, as a client probing for one would send
            assert await keys.lookup(f"random-{i}") is None
        assert len(keys._absent) == 4
        found = await keys.lookup("kept-key")
        assert found is not None and found.name == "kept"
    finally:
        await client.aclose()


async def test_random_keys_do_not_push_a_real_key_out_and_a_revoked_key_stays_out(
        redis_server: RedisServer) -> None:
    client = redis_client(redis_server.url)
    await store_key(client, "real-key", "real")
    await store_key(client, "revoked-key", "revoked")
    keys = KeyStore((), client, cache_ttl_s=0.05, cache_size=4)
    try:
        assert (await keys.lookup("real-key")).name == "real"
        assert (await keys.lookup("revoked-key")).name == "revoked"
        for i in range(50):  # a client presenting random keys
            assert await keys.lookup(f"random-{i}") is None
        await client.delete(f"dgw:apikey:{hashlib.sha256(b'revoked-key').hexdigest()}")
        await asyncio.sleep(0.1)  # its entry expired: the next lookup asks Redis
        assert await keys.lookup("revoked-key") is None  # Redis says it is gone
        redis_server.stop()  # an outage: only what was cached decides
        assert (await keys.lookup("real-key")).name == "real"  # still known, despite the 50 random keys
        assert await keys.lookup("revoked-key") is None  # known revoked: refused, not its old record
    finally:
        await client.aclose()


async def test_while_redis_hangs_a_seen_key_works_and_nobody_waits(redis_server: RedisServer) -> None:
    client = redis_client(redis_server.url)
    await store_key(client, "seen-key", "seen")
    errors: list[int] = []
    keys = KeyStore((), client, cache_ttl_s=0.05, on_error=lambda: errors.append(1))
    assert redis_server.proc is not None
    try:
        assert (await keys.lookup("seen-key")).name == "seen"
        await asyncio.sleep(0.1)  # its cache entry expired: the next lookup asks Redis
        os.kill(redis_server.proc.pid, signal.SIGSTOP)  # connections stay open, nothing answers
        try:
            record = await keys.lookup("seen-key")  # waits for the socket timeout, once
            assert record is not None and record.name == "seen" and errors  # its last record
            started = time.monotonic()
            for i in range(10):
                assert (await keys.lookup("seen-key")) is not None
                with pytest.raises(KeysUnavailable):  # never seen: 503, not "invalid key"
                    await keys.lookup(f"unknown-{i}")
            assert time.monotonic() - started < 0.2  # none of these waited for Redis
        finally:
            os.kill(redis_server.proc.pid, signal.SIGCONT)
        await client.delete(f"dgw:apikey:{hashlib.sha256(b'seen-key').hexdigest()}")
        await store_key(client, "new-key", "new")
        await asyncio.sleep(1.1)  # the next probe is due
        assert (await keys.lookup("new-key")).name == "new"
        assert await keys.lookup("seen-key") is None  # Redis answers again: what it says counts
    finally:
        await client.aclose()
