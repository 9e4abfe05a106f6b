"""A byte-bounded LRU cache: plain-text segment -> its token ids, packed as little-endian
uint32 words (kvcache/hashing.py's `pack_tokens`).

Key: the segment text itself (exact: a hit means string equality). Optionally, segments
of at least `digest_min_chars` code points are keyed by their SHA-256 digest (32 bytes)
instead, so a long message is not held twice (text + ids): that saves ~4-5 B per cached
token (~50% of an entry) but costs UTF-8 encoding + SHA-256 on every lookup (measured
on the 2-core dev box for a 520k-character prompt: 1.2 ms with digests vs 0.4 ms for
hashing + comparing the text), and is exact only up to a SHA-256 collision (~2^-128,
infeasible to forge; the trust kvcache/hashing.py already places in SHA-256). The
default keys by text: the gateway is CPU-bound, memory is bounded either way.

Memory bound: the sum of entry costs stays <= `max_bytes`. An entry costs
`sys.getsizeof(key) + len(packed) + _ENTRY_OVERHEAD`: a cached token costs its 4 packed
bytes and its share of the key text (~4-5 B for English/code, ~1 B/char of ASCII, 2 B/char
for CJK). Entries costlier than `max_bytes // 4` are not kept (one huge message must not
flush everyone else's history).

Cost: get/put are O(1) dict operations plus hashing the key (SipHash over the text,
~0.7 ns/char; equality on a hit is a memcmp). Thread-safe (one lock; the gateway calls
it from the event loop thread).
"""

from __future__ import annotations

import hashlib
import sys
import threading
from collections import OrderedDict
from dataclasses import dataclass

_ENTRY_OVERHEAD = 150  # bytes header (33) + OrderedDict node and table slot (~110)
DEFAULT_DIGEST_MIN_CHARS: int | None = None  # key every segment by its text

SegmentKey = str | bytes


@dataclass(frozen=True)
class CacheStats:
    entries: int
    bytes: int
    max_bytes: int
    hits: int
    misses: int


class SegmentCache:
    def __init__(self, max_bytes: int, *, digest_min_chars: int | None = DEFAULT_DIGEST_MIN_CHARS):
        if max_bytes < 0:
            raise ValueError("max_bytes must be >= 0")
        self.max_bytes = max_bytes
        self._digest_min_chars = digest_min_chars
        self._entries: OrderedDict[SegmentKey, tuple[bytes, int]] = OrderedDict()
        self._bytes = 0
        self._hits = 0
        self._misses = 0
        self._lock = threading.Lock()

    def key(self, text: str) -> SegmentKey:
        if self._digest_min_chars is None or len(text) < self._digest_min_chars:
            return text
        return hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()

    def get(self, key: SegmentKey) -> bytes | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self._misses += 1
                return None
            self._entries.move_to_end(key)
            self._hits += 1
            return entry[0]

    def put(self, key: SegmentKey, packed: bytes) -> None:
        cost = sys.getsizeof(key) + len(packed) + _ENTRY_OVERHEAD
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old[1]
            if cost > self.max_bytes // 4:
                return
            self._entries[key] = (packed, cost)
            self._bytes += cost
            while self._bytes > self.max_bytes:
                _, (_, evicted) = self._entries.popitem(last=False)
                self._bytes -= evicted

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(len(self._entries), self._bytes, self.max_bytes, self._hits, self._misses)
