"""Memory-tier prefix cache, KV event log and the shared in-process store."""

from __future__ import annotations

import pytest

from deepinfer_gateway.core.protocol import KvEventKind, KvTier
from deepinfer_gateway.workers.sim import prefix_cache
from deepinfer_gateway.workers.sim.kv_events import SimKvEventLog
from deepinfer_gateway.workers.sim.kv_store import InMemoryKvStore
from deepinfer_gateway.workers.sim.prefix_cache import EVICTED_MEMORY, PrefixCache

DAY = 86_400.0


def make(capacity: int) -> tuple[PrefixCache, SimKvEventLog]:
    log = SimKvEventLog("w0")
    return PrefixCache(capacity, log), log


def test_match_counts_leading_blocks_only() -> None:
    cache, _ = make(10)
    cache.insert([1, 2, 3])
    assert cache.match([1, 2, 3, 4]) == 3
    assert cache.match([1, 9, 3]) == 1
    assert cache.match([9, 1]) == 0


def test_lru_evicts_extensions_before_prefixes() -> None:
    cache, log = make(4)
    cache.insert([1, 2, 3])
    cache.insert([7, 8])  # needs one slot: the oldest is the tail of the first chain
    assert cache.match([1, 2, 3], touch=False) == 2
    assert 3 not in cache and len(cache) == 4
    evicted = [e for e in log.batch(0).events if e.kind is KvEventKind.EVICTED]
    assert [e.block_hashes for e in evicted] == [[3]]


def test_touch_on_match_protects_hot_prefixes() -> None:
    cache, _ = make(3)
    cache.insert([1, 2])
    cache.insert([5])
    cache.match([1, 2])  # now 5 is the oldest
    cache.insert([6])
    assert 5 not in cache and cache.match([1, 2]) == 2


def test_chain_longer_than_capacity_keeps_its_head() -> None:
    cache, log = make(2)
    cache.insert([1, 2, 3, 4])
    assert cache.match([1, 2, 3, 4]) == 2
    kinds = [(e.kind, e.block_hashes) for e in log.batch(0).events]
    assert kinds == [(KvEventKind.CLEARED, []), (KvEventKind.STORED, [1, 2])]


def test_event_log_is_gap_free_starts_cleared_and_pages() -> None:
    cache, log = make(3)
    for i in range(10):
        cache.insert([100 + i])
    batch = log.batch(0)
    assert batch.events[0].kind is KvEventKind.CLEARED and batch.events[0].tier is KvTier.MEMORY
    seqs = [e.seq for e in batch.events]
    assert seqs == list(range(1, batch.last_seq + 1))
    page = log.batch(after=3, limit=2)
    assert [e.seq for e in page.events] == [4, 5]
    assert log.batch(after=batch.last_seq).events == []
    assert len(log.epoch) == 32 and SimKvEventLog("w0").epoch != log.epoch


def test_event_log_retention_reports_oldest_seq() -> None:
    log = SimKvEventLog("w0", retention=5)
    for i in range(20):
        log.append(KvEventKind.STORED, KvTier.MEMORY, [i])
    batch = log.batch(0)
    assert batch.last_seq == 21 and batch.oldest_seq == 17
    assert [e.seq for e in batch.events] == [17, 18, 19, 20, 21]  # consumer must resync


def test_store_ttl_by_workload_class_and_capacity() -> None:
    store = InMemoryKvStore(capacity_blocks=3)
    put = store.put([1, 2], "agent", now=0.0)
    assert put.stored == [1, 2] and put.expires_at == 3 * DAY
    store.put([5], "chat", now=0.0)
    assert store.match([1, 2], now=3 * DAY - 1) == 2
    assert store.match([1, 2], now=3 * DAY + 1) == 0  # agent TTL expired
    assert store.match([5], now=3 * DAY + 1) == 1  # chat lives 7 days
    again = store.put([1, 2, 3, 4], "chat", now=3 * DAY + 2)  # 2 had expired too
    assert again.stored == [1, 2, 3] and len(store) == 3
    assert again.evicted == [5]


def test_evicted_blocks_are_remembered_until_cached_again() -> None:
    cache, _ = make(3)
    cache.insert([1, 2, 3])
    cache.insert([7, 8])  # evicts 3, then 2
    assert cache.evicted_among([1, 2, 3, 4]) == 2  # 4 was never held
    cache.insert([1, 2])
    assert cache.evicted_among([1, 2, 3]) == 1  # 2 is cached again


def test_the_evicted_memory_is_bounded() -> None:
    cache, _ = make(1)
    for h in range(100):
        cache.insert([h])
    assert cache.evicted_among(range(100)) == EVICTED_MEMORY  # the latest ones
    assert cache.evicted_among([98]) == 1 and cache.evicted_among([0]) == 0


def test_a_large_caches_evicted_memory_is_bounded_absolutely(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prefix_cache, "EVICTED_MAX", 5)
    cache, _ = make(10)  # 8 x 10 would be 80
    for h in range(0, 40, 2):
        cache.insert([h, h + 1])
    assert cache.evicted_among(range(40)) == 5
