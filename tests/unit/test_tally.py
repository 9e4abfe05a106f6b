"""HistogramTally: the exposition after a flush is exactly what observing each value on the
histogram would have given (every bucket, the count and the sum), whatever the values
(bucket bounds exactly, zero, negatives, beyond the last bound, +Inf) and wherever the
flushes fall; nothing reaches the histogram before a flush or FLUSH_EVERY observations."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Histogram

from deepinfer_gateway.gateway.telemetry import tally
from deepinfer_gateway.gateway.telemetry.metrics import ITL_BUCKETS
from deepinfer_gateway.gateway.telemetry.tally import HistogramTally


def histogram() -> tuple[CollectorRegistry, Histogram]:
    registry = CollectorRegistry()
    h = Histogram("itl_seconds", "gaps", ["model"], buckets=ITL_BUCKETS, registry=registry)
    return registry, h


def samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for metric in registry.collect() for s in metric.samples if not s.name.endswith("_created")}


values = st.one_of(
    st.sampled_from([*ITL_BUCKETS, 0.0, math.inf, -1.0, 5.0]),
    st.floats(min_value=-1.0, max_value=10.0, allow_nan=False),
    st.floats(allow_nan=False, allow_infinity=False).map(abs),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(values, st.booleans()), max_size=300))
def test_flushed_tally_equals_observing_each_value(observations: list[tuple[float, bool]]) -> None:
    direct_registry, direct = histogram()
    tallied_registry, tallied = histogram()
    child = direct.labels("m")
    t = HistogramTally(tallied.labels("m"))
    for value, flush_after in observations:
        child.observe(value)
        t.observe(value)
        if flush_after:
            t.flush()
    t.flush()
    want, got = samples(direct_registry), samples(tallied_registry)
    assert want.keys() == got.keys()
    for key, value in want.items():
        assert got[key] == value or math.isclose(got[key], value, rel_tol=1e-9, abs_tol=1e-12), key


def test_observations_wait_for_a_flush_or_a_full_batch() -> None:
    registry, h = histogram()
    t = HistogramTally(h.labels("m"))
    count = ("itl_seconds_count", (("model", "m"),))
    for _ in range(tally.FLUSH_EVERY - 1):
        t.observe(0.02)
    assert samples(registry)[count] == 0
    t.observe(0.02)  # the batch is full: added at once
    assert samples(registry)[count] == tally.FLUSH_EVERY
    t.observe(0.5)
    t.flush()
    t.flush()  # nothing pending: adds nothing
    assert samples(registry)[count] == tally.FLUSH_EVERY + 1
    assert samples(registry)[("itl_seconds_bucket", (("le", "0.5"), ("model", "m")))] == tally.FLUSH_EVERY + 1
    assert samples(registry)[("itl_seconds_bucket", (("le", "0.2"), ("model", "m")))] == tally.FLUSH_EVERY
