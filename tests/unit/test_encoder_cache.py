"""SegmentCache: LRU order, the byte bound, digest keys for long texts."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer_gateway.kvcache.hashing import pack_tokens
from deepinfer_gateway.recipe_bridge.segment_cache import SegmentCache


def seg(ids: list[int]) -> bytes:
    return pack_tokens(ids)


def test_hit_returns_the_stored_ids_and_counts() -> None:
    cache = SegmentCache(1 << 20)
    key = cache.key("hello")
    assert cache.get(key) is None
    cache.put(key, seg([1, 2, 3]))
    assert cache.get(key) == seg([1, 2, 3])
    stats = cache.stats()
    assert (stats.entries, stats.hits, stats.misses) == (1, 1, 1)


def test_long_texts_are_keyed_by_digest_short_by_text() -> None:
    cache = SegmentCache(1 << 20, digest_min_chars=8)
    assert cache.key("short") == "short"
    long_key = cache.key("a much longer text")
    assert isinstance(long_key, bytes) and len(long_key) == 32
    assert cache.key("a much longer text") == long_key
    assert cache.key("a much longer texT") != long_key


def test_default_keys_every_segment_by_its_text() -> None:
    text = "x" * 100_000
    assert SegmentCache(1 << 20).key(text) is text


def test_least_recently_used_is_evicted_first() -> None:
    cache = SegmentCache(1600)
    for text in ("a", "b", "c", "d"):
        cache.put(text, seg(list(range(50))))  # 400 bytes each (key 50, ids 200, overhead 150): exactly four fit
    cache.get("a")  # now b is the oldest
    cache.put("e", seg(list(range(50))))
    assert cache.get("b") is None
    assert cache.get("a") is not None and cache.get("e") is not None


def test_entry_larger_than_a_quarter_of_the_budget_is_not_kept() -> None:
    cache = SegmentCache(3000)
    cache.put("small", seg([1]))
    cache.put("huge", seg(list(range(200))))  # 800 bytes of ids > 3000 // 4
    assert cache.get("huge") is None
    assert cache.get("small") == seg([1])


def test_zero_budget_keeps_nothing() -> None:
    cache = SegmentCache(0)
    cache.put("x", seg([1]))
    assert cache.get("x") is None


@settings(max_examples=200, deadline=None)
@given(
    budget=st.integers(0, 5000),
    ops=st.lists(st.tuples(st.text(max_size=30), st.integers(0, 120)), max_size=60),
)
def test_bytes_never_exceed_budget_and_match_entries(budget: int, ops: list[tuple[str, int]]) -> None:
    cache = SegmentCache(budget, digest_min_chars=16)
    for text, n in ops:
        key = cache.key(text)
        cache.put(key, seg(list(range(n))))
        stats = cache.stats()
        assert stats.bytes <= budget
        got = cache.get(key)
        assert got is None or got == seg(list(range(n)))
    assert (cache.stats().entries == 0) == (cache.stats().bytes == 0)
