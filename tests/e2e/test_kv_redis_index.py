"""Redis backend specifics: one round trip per lookup, shared view across replicas,
Redis killed and restarted during traffic (local view, error counter, one log line, resync)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from deepinfer_gateway.config import RedisSettings
from deepinfer_gateway.infra.redis_conn import redis_client
from deepinfer_gateway.kvcache.factory import create_prefix_index
from deepinfer_gateway.kvcache.redis_index import RedisPrefixIndex
from deepinfer_gateway.kvcache.types import KvIndexMetrics
from tests.conftest import RedisServer
from tests.kv_helpers import EventLog

H = list(range(1000, 1128))


@contextlib.asynccontextmanager
async def index_on(server: RedisServer, namespace: str) -> AsyncIterator[tuple[RedisPrefixIndex, aioredis.Redis]]:
    """A Redis-backed index on `server`, and a plain client to look at the server with."""
    index = RedisPrefixIndex(redis_client(server.url), namespace=namespace)
    admin = aioredis.Redis.from_url(server.url)
    try:
        yield index, admin
    finally:
        await index.aclose()
        await admin.aclose()


def top_level_calls(stats: dict[str, dict[str, float]]) -> dict[str, float]:
    # inside the script
    inner = {"cmdstat_sismember", "cmdstat_smismember", "cmdstat_zmscore", "cmdstat_zrangebyscore", "cmdstat_info"}
    return {k: v["calls"] for k, v in stats.items() if k not in inner}


async def test_one_round_trip_per_lookup(redis_server: RedisServer) -> None:
    async with index_on(redis_server, "rt") as (index, admin):
        logs = [EventLog(f"w{i}") for i in range(8)]
        for i, log in enumerate(logs):
            log.store_mem(H[: i * 16])
            await index.apply(log.worker_id, log.batch())
        await index.lookup({"f1": H}, {"w0": "f1"})  # loads the script once
        before = top_level_calls(await admin.info("commandstats"))
        for _ in range(20):
            got = await index.lookup({"f1": H, "f2": H[:3]}, {log.worker_id: "f1" for log in logs} | {"z": "f2"})
        after = top_level_calls(await admin.info("commandstats"))
        delta = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
        assert delta == {"cmdstat_evalsha_ro": 20}
        assert dict(got.memory) == {f"w{i}": i * 16 for i in range(8)} | {"z": 0}


async def test_prompt_shorter_than_a_block_asks_redis_nothing(redis_server: RedisServer) -> None:
    async with index_on(redis_server, "short") as (index, admin):
        log = EventLog("w0")
        log.store_mem(H[:4])
        await index.apply("w0", log.batch())
        before = top_level_calls(await admin.info("commandstats"))
        got = await index.lookup({"f1": [], "f2": []}, {"w0": "f1", "w1": "f2"})
        after = top_level_calls(await admin.info("commandstats"))
        assert after == before  # no command but the INFO calls themselves (not counted)
        assert (dict(got.memory), dict(got.store)) == ({"w0": 0, "w1": 0}, {"f1": 0, "f2": 0})
        assert got == index.local.lookup_now({"f1": [], "f2": []}, {"w0": "f1", "w1": "f2"})


async def test_one_round_trip_per_lookup_on_a_cluster(redis_cluster_url: str) -> None:
    """No `COMMAND GETKEYS` detour: the cluster client routes the read-only script by its key."""
    index = RedisPrefixIndex(redis_client(redis_cluster_url, cluster=True), namespace=f"rt:{uuid.uuid4().hex[:8]}")
    admin = RedisCluster.from_url(redis_cluster_url)
    try:
        log = EventLog("w0")
        log.store_mem(H[:64])
        await index.apply("w0", log.batch())
        await index.lookup({"f1": H}, {"w0": "f1"})  # loads the script
        await admin.initialize()
        nodes = [aioredis.Redis(host=n.host, port=n.port) for n in admin.get_nodes()]
        assert len(nodes) >= 3

        async def top_level() -> dict[str, float]:
            out: dict[str, float] = {}
            for node in nodes:
                for k, v in top_level_calls(await node.info("commandstats")).items():
                    out[k] = out.get(k, 0) + v
            return out

        before = await top_level()
        for _ in range(20):
            assert (await index.lookup({"f1": H}, {"w0": "f1"})).memory == {"w0": 64}
        after = await top_level()
        delta = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
        assert delta == {"cmdstat_evalsha_ro": 20}
        for node in nodes:
            await node.aclose()
    finally:
        await index.aclose()
        await admin.aclose()


async def test_writes_skipped_during_an_outage_are_resynced(redis_server: RedisServer) -> None:
    """A lookup times out (Redis paused, data intact); a batch applied before Redis is retried
    is not sent. Another worker's later successful write must not make Redis "current": the
    skipped batch reaches Redis (full resync) before lookups use Redis again."""
    index = RedisPrefixIndex(redis_client(redis_server.url), namespace="skip", retry_interval_s=0.3)
    admin = aioredis.Redis.from_url(redis_server.url)
    try:
        a, b = EventLog("a"), EventLog("b")
        a.store_mem(H[:10])
        await index.apply("a", a.batch())
        await admin.execute_command("CLIENT", "PAUSE", "700", "ALL")
        assert (await index.lookup({"f1": H}, {"a": "f1"})).memory == {"a": 10}  # timed out: local view
        assert not index.healthy
        a.store_mem(H[10:20])
        await index.apply("a", a.batch(after=1))  # within the retry interval: not sent
        await asyncio.sleep(0.5)  # Redis serves again; the retry interval is over
        b.store_mem(H[:5])
        await index.apply("b", b.batch())
        assert index.healthy
        fresh = RedisPrefixIndex(redis_client(redis_server.url), namespace="skip")  # reads Redis only
        assert (await fresh.lookup({"f1": H}, {"a": "f1", "b": "f1"})).memory == {"a": 20, "b": 5}
        await fresh.aclose()
    finally:
        await index.aclose()
        await admin.aclose()


async def test_replicas_share_one_view_and_write_each_event_once(redis_url: str) -> None:
    """Without write leases every replica writes: the cursor in Redis makes that idempotent
    (also what happens around a lease hand-over)."""
    namespace = f"rep:{uuid.uuid4().hex[:8]}"
    a = RedisPrefixIndex(redis_client(redis_url), namespace=namespace, writer_lease_s=0)
    b = RedisPrefixIndex(redis_client(redis_url), namespace=namespace, writer_lease_s=0)
    try:
        log = EventLog("w")
        log.store_mem(H[:32])
        assert await a.apply("w", log.batch()) == 1
        # Replica b never polled the worker, yet routes by what a learned.
        assert (await b.lookup({"f1": H}, {"w": "f1"})).memory == {"w": 32}
        # b polls later and re-applies the same events: a no-op in Redis.
        log.evict_mem(H[8:9])
        await a.apply("w", log.batch(after=1))
        assert await b.apply("w", log.batch()) == 2
        assert (await a.lookup({"f1": H}, {"w": "f1"})).memory == {"w": 8}
        # b ahead of a: a's stale batch must not roll Redis back.
        log.store_mem(H[8:9])
        await b.apply("w", log.batch(after=2))
        await a.apply("w", log.only(2))
        assert (await a.lookup({"f1": H}, {"w": "f1"})).memory == {"w": 32}
    finally:
        await a.aclose()
        await b.aclose()


async def test_replica_with_a_gap_in_redis_pushes_its_snapshot(redis_url: str) -> None:
    namespace = f"gap:{uuid.uuid4().hex[:8]}"
    a = RedisPrefixIndex(redis_client(redis_url), namespace=namespace, writer_lease_s=0)
    b = RedisPrefixIndex(redis_client(redis_url), namespace=namespace, writer_lease_s=0)
    try:
        log = EventLog("w")
        log.store_mem(H[:10])
        await a.apply("w", log.batch())  # Redis at seq 1
        log.store_mem(H[10:20])
        log.store_mem(H[20:30])
        await b.apply("w", log.batch())  # b's local view at 3; Redis: 1 -> 2 -> 3 applied in order
        await b.apply("w", log.batch(after=3))
        local_only = RedisPrefixIndex(redis_client(redis_url), namespace=namespace)
        assert (await local_only.lookup({"f1": H}, {"w": "f1"})).memory == {"w": 30}
        await local_only.aclose()
        # c's local view learned seq 4 while Redis did not (e.g. Redis was briefly away):
        # its next batch leaves a gap in Redis, which c fills with its snapshot.
        log.store_mem(H[30:40])
        log.store_mem(H[40:50])
        c = RedisPrefixIndex(redis_client(redis_url), namespace=namespace, writer_lease_s=0)
        c.local.apply_now("w", log.only(1, 2, 3, 4))
        assert await c.apply("w", log.only(5)) == 5
        fresh = RedisPrefixIndex(redis_client(redis_url), namespace=namespace)
        assert (await fresh.lookup({"f1": H}, {"w": "f1"})).memory == {"w": 50}
        await c.aclose()
        await fresh.aclose()
    finally:
        await a.aclose()
        await b.aclose()


async def test_one_replica_writes_a_workers_events_until_its_lease_lapses(redis_server: RedisServer) -> None:
    """Per worker, the replica holding the write lease sends its batches to Redis; another
    replica applies them locally only, tries Redis once per lease period, and takes over
    (pushing its snapshot over the gap) once the holder stops renewing."""
    namespace = f"lease:{uuid.uuid4().hex[:8]}"
    admin = aioredis.from_url(redis_server.url)
    # 5 s client timeouts: on a loaded machine one reply slower than the default 0.5 s would
    # turn an index to its local view (the reader's is empty), which is not what this tests.
    # A 2 s lease: the steps below that must fall inside one lease period do on a loaded box.
    a = RedisPrefixIndex(redis_client(redis_server.url, timeout_s=5), namespace=namespace, writer_lease_s=2.0)
    b = RedisPrefixIndex(redis_client(redis_server.url, timeout_s=5), namespace=namespace, writer_lease_s=2.0)
    reader = RedisPrefixIndex(redis_client(redis_server.url, timeout_s=5), namespace=namespace)
    try:
        log = EventLog("w")
        log.store_mem(H[:10])
        await a.apply("w", log.batch())  # a takes w's lease
        await admin.config_resetstat()
        b_cursor = 0
        for n in range(2, 6):  # b polls the same events; a (the holder) keeps writing them
            log.store_mem(H[10 * (n - 1) : 10 * n])
            await a.apply("w", log.batch(after=n - 1))
            b_cursor = await b.apply("w", log.batch(after=b_cursor))
        calls = (await admin.info("commandstats"))["cmdstat_evalsha"]["calls"]
        assert calls == 4 + 1  # a's four batches, b's one attempt that learned of a's lease
        assert b.metrics.registry.get_sample_value("dgw_kv_index_writes_deferred_total") == 4
        assert (await b.stats())["redis"]["workers_written_elsewhere"] == ["w"]
        assert (await reader.lookup({"f1": H}, {"w": "f1"})).memory == {"w": 50}
        # a stops (dies, or lost the worker); b's batches go on, local only, until the lease lapses.
        log.store_mem(H[50:60])
        b_cursor = await b.apply("w", log.batch(after=b_cursor))
        assert (await reader.lookup({"f1": H}, {"w": "f1"})).memory == {"w": 50}
        assert (await b.lookup({"f1": H}, {"w": "f1"})).memory == {"w": 50}  # b routes by Redis
        await asyncio.sleep(2.1)
        log.store_mem(H[60:70])
        await b.apply("w", log.batch(after=b_cursor))  # takes the lease; Redis misses seq 6: snapshot
        assert (await reader.lookup({"f1": H}, {"w": "f1"})).memory == {"w": 70}
        assert (await b.stats())["redis"]["workers_written_elsewhere"] == []
        await a.apply("w", log.batch(after=5))  # a is back: b holds the lease now
        assert a.metrics.registry.get_sample_value("dgw_kv_index_writes_deferred_total") == 1
        assert (await reader.lookup({"f1": H}, {"w": "f1"})).memory == {"w": 70}
    finally:
        for index in (a, b, reader):
            await index.aclose()
        await admin.aclose()


async def test_big_snapshot_is_staged_in_chunks_then_swapped_in(redis_url: str) -> None:
    namespace = f"snap:{uuid.uuid4().hex[:8]}"
    admin = aioredis.Redis.from_url(redis_url)
    big = list(range(1, 20_001))  # three upload calls of 8,192
    # Patient clients: this checks staging, not the gateway's 0.5 s fail-fast timeout, which a
    # busy 2-core CI machine can exceed while another client uploads 20,000 hashes.
    pusher = RedisPrefixIndex(redis_client(redis_url, timeout_s=5.0), namespace=namespace)
    stale = RedisPrefixIndex(redis_client(redis_url, timeout_s=5.0), namespace=namespace)
    try:
        log = EventLog("w")
        log.store_mem(big)
        log.store_mem([99_999_999])
        pusher.local.apply_now("w", log.only(1, 2))
        await pusher._push_worker("w")  # what a gap or a wiped Redis triggers
        assert await admin.scard(pusher.mem_key("w")) == 20_001
        assert (await pusher.lookup({"f1": big[:300]}, {"w": "f1"})).memory == {"w": 300}
        # A replica whose view is older than Redis's (seq 1 < 2) changes nothing.
        stale.local.apply_now("w", log.only(1))
        await stale._push_worker("w")
        assert await admin.scard(pusher.mem_key("w")) == 20_001
        assert [k async for k in admin.scan_iter(match=f"{{{namespace}}}:staged:*")] == []
    finally:
        await pusher.aclose()
        await stale.aclose()
        await admin.aclose()


async def test_redis_killed_and_restarted_during_traffic(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    # A killed Redis refuses connections at once: the client's timeout is not what detects the
    # outage, and a short one would make a busy machine's slow reply a second outage (a second log).
    metrics = KvIndexMetrics()
    index = RedisPrefixIndex(
        redis_client(redis_server.url, timeout_s=5), namespace="outage", metrics=metrics, retry_interval_s=0.1
    )
    logs = [EventLog(f"w{i}") for i in range(4)]
    cursors = dict.fromkeys((log.worker_id for log in logs), 0)
    stop = asyncio.Event()
    wrong: list[object] = []
    step = 0

    async def traffic() -> None:
        nonlocal step
        while not stop.is_set():
            log = logs[step % len(logs)]
            i = step // len(logs)
            if i < len(H):
                log.store_mem([H[i]])
            cursors[log.worker_id] = await index.apply(log.worker_id, log.batch(after=cursors[log.worker_id]))
            expected = min(len(H), i + 1)
            got = await index.lookup({"f1": H}, {log.worker_id: "f1"})
            if got.memory[log.worker_id] != expected:
                wrong.append((step, got.memory, expected))
            step += 1
            await asyncio.sleep(0.002)

    caplog.set_level(logging.WARNING, logger="deepinfer_gateway.kvcache.redis_index")
    task = asyncio.create_task(traffic())
    try:
        await asyncio.sleep(0.3)
        redis_server.stop()
        for _ in range(200):  # the next apply or lookup notices
            await asyncio.sleep(0.05)
            if not index.healthy:
                break
        assert not index.healthy
        stats = await index.stats()  # the operator's view says so, and still shows the local view
        assert not stats["redis"]["healthy"] and "error" in stats["redis"] and stats["workers"], stats
        during_outage = step
        redis_server.start()  # empty: no persistence
        for _ in range(600):
            await asyncio.sleep(0.05)
            if index.healthy and step > during_outage + 20:
                break
        await asyncio.sleep(0.2)
    finally:
        stop.set()
        await task
    assert not wrong, wrong[:5]  # lookups stayed correct throughout (local view during the outage)
    assert index.healthy
    assert metrics.error_count("apply") + metrics.error_count("lookup") >= 1
    outage_logs = [r for r in caplog.records if "Redis unavailable" in r.getMessage()]
    assert len(outage_logs) == 1
    # Redis itself holds the full state again: a replica with an empty local view sees it.
    fresh = RedisPrefixIndex(redis_client(redis_server.url), namespace="outage")
    want = {log.worker_id: min(len(H), (step - 1 - k) // len(logs) + 1) for k, log in enumerate(logs)}
    got = await fresh.lookup({"f1": H}, {log.worker_id: "f1" for log in logs})
    assert dict(got.memory) == want
    await fresh.aclose()
    await index.aclose()


async def test_wiped_redis_is_refilled_without_an_observed_failure(redis_server: RedisServer) -> None:
    async with index_on(redis_server, "wipe") as (index, admin):
        log = EventLog("w")
        log.store_mem(H[:20])
        log.store_store(H[:40], None)
        cursor = await index.apply("w", log.batch())
        await admin.flushall()
        assert (await index.lookup({"f1": H}, {"w": "f1"})).memory == {"w": 0}  # under-prediction only
        log.store_mem(H[20:30])
        await index.apply("w", log.batch(after=cursor))
        got = await index.lookup({"f1": H}, {"w": "f1"})
        assert dict(got.memory) == {"w": 30} and dict(got.store) == {"f1": 40}


async def test_factory_picks_the_backend(redis_url: str) -> None:
    memory = create_prefix_index(None)
    shared = create_prefix_index(RedisSettings(url=redis_url), namespace=f"f:{uuid.uuid4().hex[:6]}")
    assert type(memory).__name__ == "InMemoryPrefixIndex"
    assert isinstance(shared, RedisPrefixIndex)
    await memory.aclose()
    await shared.aclose()
