"""One contract for every PrefixIndex backend: in-memory, Redis and Redis Cluster (real redis-servers)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable

import pytest

from deepinfer_gateway.core.protocol import KvEventKind, KvTier
from deepinfer_gateway.infra.redis_conn import redis_client
from deepinfer_gateway.kvcache.memory import InMemoryPrefixIndex
from deepinfer_gateway.kvcache.redis_index import RedisPrefixIndex
from deepinfer_gateway.kvcache.types import Overlap, PrefixIndex
from tests.conftest import redis_backend_url
from tests.kv_helpers import EventLog

Factory = Callable[..., PrefixIndex]
H = list(range(1000, 1064))  # a prompt's block hashes (format "f1")
G = list(range(5000, 5064))  # the same prompt salted for format "f2"


@pytest.fixture(params=["memory", "redis", "redis-cluster"])
async def make_index(request: pytest.FixtureRequest) -> AsyncIterator[Factory]:
    made: list[PrefixIndex] = []
    url = None if request.param == "memory" else redis_backend_url(request, request.param)

    def make(**kwargs: object) -> PrefixIndex:
        index: PrefixIndex
        if url is None:
            index = InMemoryPrefixIndex(**kwargs)
        else:  # each index its own namespace: on the cluster, its own hash slot (and node)
            namespace = f"test:{uuid.uuid4().hex[:8]}"
            # The contract is the results, not the gateway's fail-fast 0.5 s timeout, which 32
            # concurrent callers connecting to a cluster on a busy machine can pass.
            client = redis_client(url, cluster=request.param == "redis-cluster", timeout_s=10)
            index = RedisPrefixIndex(client, namespace=namespace, **kwargs)
        made.append(index)
        return index

    yield make
    for index in made:
        await index.aclose()


async def lookup(index: PrefixIndex, workers: dict[str, str], hashes: list[int] = H) -> Overlap:
    return await index.lookup({"f1": hashes}, workers)


async def test_leading_memory_blocks_per_worker(make_index: Factory) -> None:
    index = make_index()
    a, b = EventLog("a"), EventLog("b")
    a.store_mem(H[:40])
    b.store_mem(H[:10] + H[11:30])  # block 10 missing: only 10 leading blocks count
    assert await index.apply("a", a.batch()) == 1
    await index.apply("b", b.batch())
    got = await lookup(index, {"a": "f1", "b": "f1", "c": "f1"})
    assert dict(got.memory) == {"a": 40, "b": 10, "c": 0}
    assert dict(got.store) == {"f1": 0}


async def test_full_prompt_and_empty_prompt(make_index: Factory) -> None:
    index = make_index()
    a = EventLog("a")
    a.store_mem(H)
    await index.apply("a", a.batch())
    assert (await lookup(index, {"a": "f1"})).memory == {"a": 64}
    assert (await lookup(index, {"a": "f1"}, [])).memory == {"a": 0}
    assert (await index.lookup({}, {"a": "f1"})).memory == {"a": 0}


async def test_eviction_cuts_the_prefix(make_index: Factory) -> None:
    index = make_index()
    a = EventLog("a")
    a.store_mem(H[:50])
    await index.apply("a", a.batch())
    a.evict_mem([H[20]])
    assert await index.apply("a", a.batch(after=1)) == 2
    assert (await lookup(index, {"a": "f1"})).memory == {"a": 20}


async def test_cleared_event_drops_the_workers_memory_tier(make_index: Factory) -> None:
    index = make_index()
    a, b = EventLog("a"), EventLog("b")
    a.store_mem(H)
    b.store_mem(H)
    await index.apply("a", a.batch())
    await index.apply("b", b.batch())
    a.add(KvEventKind.CLEARED, KvTier.MEMORY, [])
    await index.apply("a", a.batch(after=1))
    assert (await lookup(index, {"a": "f1", "b": "f1"})).memory == {"a": 0, "b": 64}


async def test_store_tier_per_format_with_leading_blocks(make_index: Factory) -> None:
    index = make_index()
    a = EventLog("a")
    far = time.time() + 3600
    a.store_store(H[:30] + H[31:40], far)
    a.store_store(G[:64], far)
    await index.apply("a", a.batch())
    got = await index.lookup({"f1": H, "f2": G}, {"a": "f1", "x": "f2", "y": "f3"})
    assert dict(got.store) == {"f1": 30, "f2": 64}
    assert dict(got.memory) == {"a": 0, "x": 0, "y": 0}


async def test_store_entries_expire_by_ttl(make_index: Factory) -> None:
    index = make_index(default_store_ttl_s=0.3)
    a = EventLog("a")
    now = time.time()
    a.store_store(H[:10], now + 0.3)
    a.store_store(H[10:20], now + 3600)
    a.store_store(H[20:30], None)  # default TTL
    await index.apply("a", a.batch())
    assert (await lookup(index, {})).store == {"f1": 30}
    await asyncio.sleep(0.45)
    assert (await lookup(index, {})).store == {"f1": 0}  # leading blocks expired
    a.store_store(H[:10], time.time() + 3600)  # re-stored: back, up to the next expired block
    await index.apply("a", a.batch(after=3))
    assert (await lookup(index, {})).store == {"f1": 20}


LONG = list(range(10_000, 11_200))  # 1,200 blocks: several of the Redis script's 512-block passes


@pytest.mark.parametrize("holes", [[], [5], [700], [5, 700], [1199]])
async def test_long_prompts_count_up_to_the_first_missing_block(make_index: Factory, holes: list[int]) -> None:
    index = make_index()
    a, b = EventLog("a"), EventLog("b")
    a.store_mem([h for i, h in enumerate(LONG[:1000]) if i not in holes])
    b.store_mem(LONG[:1] + LONG[2:])  # everything but block 1
    await index.apply("a", a.batch())
    await index.apply("b", b.batch())
    expected = min([*holes, 1000])
    assert dict((await lookup(index, {"a": "f1", "b": "f1"}, LONG)).memory) == {"a": expected, "b": 1}


async def test_expired_store_entry_cuts_a_long_prefix(make_index: Factory) -> None:
    index = make_index()
    a = EventLog("a")
    now = time.time()
    expiry = now + 2.0  # room for a loaded machine to apply and look up 1,200 hashes before it
    a.store_store(LONG[:3] + LONG[4:], now + 3600)
    a.store_store(LONG[3:4], expiry)
    await index.apply("a", a.batch())
    assert (await lookup(index, {}, LONG)).store == {"f1": 1200}
    await asyncio.sleep(max(0.0, expiry + 0.15 - time.time()))  # expired, and no apply since has purged it
    assert (await lookup(index, {}, LONG)).store == {"f1": 3}


async def test_store_eviction(make_index: Factory) -> None:
    index = make_index()
    a = EventLog("a")
    a.store_store(H, time.time() + 3600)
    a.add(KvEventKind.EVICTED, KvTier.STORE, [H[5]])
    await index.apply("a", a.batch())
    assert (await lookup(index, {})).store == {"f1": 5}


async def test_new_epoch_drops_memory_and_rereads(make_index: Factory) -> None:
    index = make_index()
    a = EventLog("a")
    a.store_mem(H)
    await index.apply("a", a.batch())
    a.restart("e2")
    a.store_mem(H[:5])
    # Polled with the old epoch's cursor: the worker answers from its new epoch.
    cursor = await index.apply("a", a.batch(after=1))
    assert cursor == 0
    assert (await lookup(index, {"a": "f1"})).memory == {"a": 0}
    assert await index.apply("a", a.batch(after=cursor)) == 2
    assert (await lookup(index, {"a": "f1"})).memory == {"a": 5}


async def test_gap_resyncs_from_the_oldest_retained_event(make_index: Factory) -> None:
    index = make_index()
    a = EventLog("a")
    for i in range(0, 60, 10):
        a.store_mem(H[i : i + 10])
    await index.apply("a", a.only(1, 2))
    assert (await lookup(index, {"a": "f1"})).memory == {"a": 20}
    cursor = await index.apply("a", a.only(4, 5))  # event 3 missing
    assert cursor == 0
    assert (await lookup(index, {"a": "f1"})).memory == {"a": 0}
    assert await index.apply("a", a.batch(after=cursor)) == 6
    assert (await lookup(index, {"a": "f1"})).memory == {"a": 60}


async def test_fell_behind_retention_applies_from_oldest(make_index: Factory) -> None:
    index = make_index()
    a = EventLog("a", retention=2)
    a.store_mem(H[:10])
    await index.apply("a", a.batch())
    a.store_mem([9_999_999])  # seq 2, later trimmed
    a.store_mem(H[10:20])
    a.store_mem(H[20:30])  # retained: seqs 3, 4
    assert a.oldest_seq == 3
    # Behind: the index drops what it knew and applies the retained log (seq 3, 4).
    assert await index.apply("a", a.batch(after=1)) == 4
    got = await index.lookup({"f1": H[10:30]}, {"a": "f1"})
    assert got.memory == {"a": 20}
    assert (await lookup(index, {"a": "f1"})).memory == {"a": 0}  # H[:10] was dropped


async def test_overlapping_polls_are_idempotent(make_index: Factory) -> None:
    index = make_index()
    a = EventLog("a")
    a.store_mem(H[:10])
    a.evict_mem(H[5:10])
    a.store_mem(H[10:20])
    assert await index.apply("a", a.batch()) == 3
    assert await index.apply("a", a.batch()) == 3
    assert await index.apply("a", a.batch(after=1)) == 3
    assert (await lookup(index, {"a": "f1"})).memory == {"a": 5}


async def test_remove_worker(make_index: Factory) -> None:
    index = make_index()
    a, b = EventLog("a"), EventLog("b")
    a.store_mem(H)
    b.store_mem(H[:3])
    await index.apply("a", a.batch())
    await index.apply("b", b.batch())
    await index.remove_worker("a")
    assert (await lookup(index, {"a": "f1", "b": "f1"})).memory == {"a": 0, "b": 3}
    await index.apply("a", a.batch())  # comes back: re-read from scratch
    assert (await lookup(index, {"a": "f1", "b": "f1"})).memory == {"a": 64, "b": 3}


async def test_memory_tier_is_capped_per_worker(make_index: Factory) -> None:
    index = make_index(max_blocks_per_worker=16)
    a = EventLog("a")
    a.store_mem(list(range(1, 200)))
    await index.apply("a", a.batch())
    present = 0
    for h in range(1, 200):
        present += (await index.lookup({"f1": [h]}, {"a": "f1"})).memory["a"]
    assert present == 16


async def test_concurrent_applies_and_lookups(make_index: Factory) -> None:
    index = make_index()
    logs = [EventLog(f"w{i}") for i in range(32)]

    async def feed(log: EventLog, n: int) -> None:
        cursor = 0
        for k in range(8):
            log.store_mem(H[k * 8 : k * 8 + 8][: max(0, n - k * 8)] or [10**9 + k])
            cursor = await index.apply(log.worker_id, log.batch(after=cursor))
            await lookup(index, {log.worker_id: "f1"})

    await asyncio.gather(*(feed(log, i * 2) for i, log in enumerate(logs)))
    got = await lookup(index, {log.worker_id: "f1" for log in logs})
    assert dict(got.memory) == {f"w{i}": min(64, i * 2) for i in range(32)}


async def test_store_tier_is_capped(make_index: Factory) -> None:
    index = make_index(max_store_blocks=10)
    a = EventLog("a")
    base = time.time() + 3600
    for i, h in enumerate(H[:30]):  # written in expiry order: both eviction policies agree
        a.store_store([h], base + i)
    await index.apply("a", a.batch())
    assert (await lookup(index, {}, H[20:30])).store == {"f1": 10}
    assert (await lookup(index, {}, H[19:30])).store == {"f1": 0}


async def test_store_cleared_event_drops_the_store_tier(make_index: Factory) -> None:
    index = make_index()
    a = EventLog("a")
    a.store_store(H, time.time() + 3600)
    a.store_mem(H)
    a.add(KvEventKind.CLEARED, KvTier.STORE, [])
    await index.apply("a", a.batch())
    got = await lookup(index, {"a": "f1"})
    assert dict(got.store) == {"f1": 0} and dict(got.memory) == {"a": 64}


async def test_stats_count_blocks_per_worker_and_store_entries(make_index: Factory) -> None:
    index = make_index()
    a, b = EventLog("a"), EventLog("b")
    a.store_mem(H[:40])
    a.store_store(H[:25], time.time() + 3600)
    b.store_mem(H[:7])
    b.evict_mem(H[5:7])
    await index.apply("a", a.batch())
    await index.apply("b", b.batch())
    stats = await index.stats()
    assert stats["store_entries"] == 25
    assert {w: (s["memory_blocks"], s["last_seq"]) for w, s in stats["workers"].items()} == {"a": (40, 2), "b": (5, 2)}
    if stats["backend"] == "redis":  # what Redis holds, next to the local view
        assert stats["redis"]["store_entries"] == 25 and stats["redis"]["healthy"]
        assert {w: s["redis_memory_blocks"] for w, s in stats["workers"].items()} == {"a": 40, "b": 5}
