"""Histogram observations counted here and added to their prometheus-client Histogram in batches.

A streamed request's inter-token latency is observed once per relayed chunk, and
`Histogram.observe` takes a lock twice and scans the buckets in Python: ~5% of the relay's
CPU per chunk. `HistogramTally` counts each observation in its bucket (one bisect over the
histogram's own bounds) and adds the counts every FLUSH_EVERY observations and at the end
(`flush`). The exposition is what observing each value would give (tests/unit/test_tally.py);
an observation only reaches it later, by at most FLUSH_EVERY of its request's.
"""

from __future__ import annotations

from bisect import bisect_left

from prometheus_client import Histogram

FLUSH_EVERY = 64  # ~1 s of a 50 tokens/s stream


class HistogramTally:
    """Observations of one Histogram child (labels applied), pending until `flush`."""

    __slots__ = ("_histogram", "_bounds", "_counts", "_sum", "_pending")

    def __init__(self, histogram: Histogram):
        self._histogram = histogram
        # prometheus-client's own bounds (ending in +Inf): an observation goes in the first
        # bucket whose bound is >= it, exactly as `Histogram.observe` places it.
        self._bounds: list[float] = histogram._upper_bounds
        self._counts = [0] * len(self._bounds)
        self._sum = 0.0
        self._pending = 0

    def observe(self, amount: float) -> None:
        """`amount`: a number, not NaN (prometheus-client would count a NaN in no bucket)."""
        self._counts[bisect_left(self._bounds, amount)] += 1
        self._sum += amount
        self._pending += 1
        if self._pending >= FLUSH_EVERY:
            self.flush()

    def flush(self) -> None:
        if not self._pending:
            return
        histogram, counts = self._histogram, self._counts
        histogram._sum.inc(self._sum)
        for i, count in enumerate(counts):
            if count:
                histogram._buckets[i].inc(count)
                counts[i] = 0
        self._sum = 0.0
        self._pending = 0
