"""Oracle prefix hit rate: hand-built cases and the figures in shared/traces/README.md."""

from __future__ import annotations

import pytest

from deepinfer_gateway.workload.oracle import oracle_hit_rate
from deepinfer_gateway.workload.traces import load_trace
from deepinfer_gateway.workload.types import TraceRequest
from tests.shared_data import TRACES, needs_shared


def req(i: int, t: float, length: int, ids: tuple[int, ...] | None) -> TraceRequest:
    return TraceRequest(i, t, length, 1, ids)


def test_prefix_chain_first_miss_ends_hits_and_partial_block_weight() -> None:
    requests = [
        req(0, 0.0, 1024, (1, 2)),
        req(1, 1.0, 1100, (1, 2, 3)),  # 512 + 512 hit, 76 miss
        req(2, 2.0, 1536, (1, 9, 3)),  # 512 hit, then miss: block 3 after 9 is another chain
    ]
    assert oracle_hit_rate(requests, 512) == pytest.approx((1024 + 512) / (1024 + 1100 + 1536))


def test_same_timestamp_keeps_order_and_no_self_hits() -> None:
    requests = [req(0, 0.0, 512, (7,)), req(1, 0.0, 512, (7,))]
    assert oracle_hit_rate(requests, 512) == pytest.approx(0.5)
    assert oracle_hit_rate([req(0, 0.0, 1024, (7, 7))], 512) == 0.0


def test_no_hash_ids_is_none() -> None:
    assert oracle_hit_rate([req(0, 0.0, 10, None)], 512) is None


@needs_shared(TRACES)
@pytest.mark.parametrize(("name", "expected"), [
    ("mooncake_conversation_trace.first_half.jsonl.gz", 0.3465),
    ("mooncake_synthetic_trace.jsonl.gz", 0.6512),
])
def test_readme_figures(name: str, expected: float) -> None:
    trace = load_trace(str(TRACES / name))
    assert round(oracle_hit_rate(trace.requests, trace.block_size) or 0, 4) == expected
