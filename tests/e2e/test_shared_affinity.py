"""The replicas' shared session memory (gateway/serving/shared_affinity.py) on a real Redis:
what one replica writes another reads, keys expire, a subagent's first request reads its
parent's worker, and a Redis outage falls back to the replica's own memory and comes back."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from deepinfer_gateway.config import RedisSettings
from deepinfer_gateway.core.session_identity import SessionIdentity
from deepinfer_gateway.gateway.serving.shared_affinity import SharedAffinity, affinity_key
from deepinfer_gateway.infra.redis_conn import redis_client_for
from deepinfer_gateway.router.policy import Lineage
from tests.conftest import RedisServer, redis_backend_url


@pytest.mark.parametrize("backend", ["redis", "redis-cluster"])
async def test_one_replica_reads_what_another_wrote(request: pytest.FixtureRequest, backend: str) -> None:
    url = redis_backend_url(request, backend)
    settings = RedisSettings(url=url, cluster=backend == "redis-cluster")
    a, b = (redis_client_for(settings) for _ in range(2))
    try:
        one, two = SharedAffinity(a, ttl_s=60), SharedAffinity(b, ttl_s=60)
        root, child = uuid.uuid4().hex, uuid.uuid4().hex
        assert await two.lineage(SessionIdentity(root)) == Lineage(shared=True)  # nothing remembered yet
        await one.remember(root, "w-2")
        assert await two.lineage(SessionIdentity(root)) == Lineage(shared=True, session_worker="w-2")
        first = await two.lineage(SessionIdentity(child, root))  # a subagent's first request
        assert first == Lineage(root, shared=True, parent_worker="w-2")
        await two.remember(child, "w-3")
        assert await one.lineage(SessionIdentity(child, root)) == Lineage(root, shared=True, session_worker="w-3")
        assert 0 < await a.pttl(affinity_key(root)) <= 60_000
    finally:
        for client in (a, b):
            await client.aclose()


async def test_a_session_is_forgotten_after_its_ttl(redis_url: str) -> None:
    client = redis_client_for(RedisSettings(url=redis_url))
    try:
        store, sid = SharedAffinity(client, ttl_s=0.2), uuid.uuid4().hex
        await store.remember(sid, "w-1")
        assert (await store.lineage(SessionIdentity(sid))).session_worker == "w-1"
        await asyncio.sleep(0.4)
        assert (await store.lineage(SessionIdentity(sid))).session_worker is None
    finally:
        await client.aclose()


async def test_an_outage_falls_back_to_the_local_memory_and_recovers(redis_server: RedisServer) -> None:
    client = redis_client_for(RedisSettings(url=redis_server.url, timeout_s=0.5))
    errors: list[int] = []
    store = SharedAffinity(client, ttl_s=60, on_error=lambda: errors.append(1))
    try:
        await store.remember("s", "w-1")
        redis_server.stop()
        assert await store.lineage(SessionIdentity("s", "p")) == Lineage("p")  # not shared: the policy's own memory
        await store.remember("s", "w-2")  # skipped while Redis is out (no wait per request)
        assert len(errors) == 1
        redis_server.start()
        await asyncio.sleep(1.1)  # the outage's retry interval
        assert await store.lineage(SessionIdentity("s")) == Lineage(shared=True)  # a new, empty Redis
        await store.remember("s", "w-2")
        assert (await store.lineage(SessionIdentity("s"))).session_worker == "w-2"
    finally:
        await client.aclose()
