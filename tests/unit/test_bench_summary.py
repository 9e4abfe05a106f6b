"""summarize() on hand-built records; gateway /metrics parsing."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from deepinfer_gateway.loadgen import gateway_metrics
from deepinfer_gateway.workload.summary import (
    CostModel,
    Slo,
    TierTokens,
    distribution,
    parse_percentiles,
    percentile,
    summarize,
)
from deepinfer_gateway.workload.types import RecordError, RequestRecord


def rec(i: int, ttft: float, e2e: float, out: int, prompt: int = 1000, cached: int | None = 500,
        itl: list[float] | None = None, t: float = 0.0) -> RequestRecord:
    return RequestRecord(index=i, arrival_s=t, ttft_s=ttft, e2e_s=e2e, output_tokens=out, prompt_tokens=prompt,
                         cached_tokens=cached, itl_s=itl or [], worker=f"w{i % 2}")


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert [percentile(values, p) for p in (50, 90, 99, 100)] == [50.0, 90.0, 99.0, 100.0]
    assert percentile([3.0, 1.0, 2.0, 4.0], 50) == 2.0
    assert percentile([], 50) is None


def test_percentile_rank_is_exact_where_float_arithmetic_is_not() -> None:
    values = [float(v) for v in range(1, 101)]
    # 7/100 * 100 is 7.000000000000001 in floats: a float ceil would pick the 8th sample.
    assert percentile(values, 7) == 7.0 and percentile(values, 14) == 14.0
    assert percentile(values, 99.9) == 100.0 and percentile(values, 0) == 1.0


@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=300), st.integers(0, 100))
def test_percentile_is_numpy_inverted_cdf(values: list[float], p: int) -> None:
    assert percentile(values, p) == float(np.percentile(values, p, method="inverted_cdf"))


def test_distribution_has_chosen_and_contract_percentiles_and_spread() -> None:
    values = [0.3, 0.1, 0.2, 0.9, 0.5]
    d = distribution(values, (95, 99.9))
    assert list(d) == ["p50", "p90", "p95", "p99", "p99.9", "mean", "std", "min", "max", "count"]
    assert d["p95"] == 0.9 and d["p50"] == 0.3
    assert d["min"] == 0.1 and d["max"] == 0.9 and d["count"] == 5
    assert d["mean"] == pytest.approx(np.mean(values)) and d["std"] == pytest.approx(np.std(values))
    empty = distribution([])
    assert empty["count"] == 0 and all(empty[k] is None for k in ("p50", "mean", "std", "min", "max"))


def test_parse_percentiles() -> None:
    assert parse_percentiles("99, 50,90,95,50") == (50.0, 90.0, 95.0, 99.0)
    assert parse_percentiles("99.9") == (99.9,)
    for bad, reason in (("50,abc", "not a number"), ("101", "outside 0..100"), (",", "no percentile")):
        with pytest.raises(ValueError, match=reason):
            parse_percentiles(bad)


def test_summary_names_its_percentiles_and_method() -> None:
    records = [rec(i, ttft=0.1 * (i + 1), e2e=1.0 + i, out=10, itl=[0.01 * (i + 1)] * 9) for i in range(20)]
    s = summarize(records, wall_s=10.0, percentiles=(50, 95))
    stats = s["statistics"]
    assert stats["percentiles"] == [50, 95] and stats["keys"] == ["p50", "p90", "p95", "p99"]
    assert "nearest-rank" in stats["percentile_method"] and "inverted_cdf" in stats["percentile_method"]
    assert "/ n" in stats["std_method"] and set(stats["samples"]) >= {"ttft_s", "itl_s", "e2e_s"}
    assert s["ttft_s"]["p95"] == pytest.approx(1.9) and s["ttft_s"]["p99"] == pytest.approx(2.0)
    assert s["e2e_s"]["min"] == 1.0 and s["e2e_s"]["max"] == 20.0
    assert s["e2e_s"]["std"] == pytest.approx(np.std([1.0 + i for i in range(20)]))
    assert s["itl_s"]["count"] == 180 and s["itl_s"]["max"] == pytest.approx(0.2)


def test_summary_figures() -> None:
    records = [rec(i, ttft=0.1 * (i + 1), e2e=0.1 * (i + 1) + 0.99, out=100, itl=[0.01] * 99, t=float(i))
               for i in range(10)]
    records.append(RequestRecord(index=10, arrival_s=10.0, status="error", error=RecordError.HTTP_5XX, http_status=503))
    records.append(RequestRecord(index=11, arrival_s=11.0, status="error", error=RecordError.TIMEOUT))
    s = summarize(records, wall_s=20.0, oracle_hit_rate=0.4, slo=Slo(ttft_s=0.5, tpot_s=0.02),
                  cost=CostModel(gpus=4, gpu_hour_usd=2.0), tiers=TierTokens(memory=3000, store=1000, prompt=10000),
                  client_cpu_s=0.12, hit_window_s=5.0)
    assert s["requests"] == 12 and s["completed"] == 10
    assert s["errors"] == {"http_5xx": 1, "timeout": 1}
    assert s["ttft_s"]["p50"] == pytest.approx(0.5) and s["ttft_s"]["p90"] == pytest.approx(0.9)
    assert s["ttft_s"]["p99"] == pytest.approx(1.0)
    assert s["tpot_s"]["p50"] == pytest.approx(0.01) and s["itl_s"]["p99"] == pytest.approx(0.01)
    assert s["e2e_s"]["p50"] == pytest.approx(1.49)
    assert s["throughput"] == pytest.approx({"requests_per_s": 0.5, "output_tokens_per_s": 50.0,
                                             "input_tokens_per_s": 500.0, "output_tokens_per_s_per_gpu": 12.5})
    cache = s["cache_hit_rate"]
    assert cache["total"] == pytest.approx(0.5) and cache["memory"] == 0.3 and cache["store"] == 0.1
    assert [p["t_s"] for p in cache["over_time"]] == [0.0, 5.0]
    assert s["oracle_hit_rate"] == 0.4
    # goodput: ttft <= 0.5 and tpot 0.01 <= 0.02 -> 5 of 12 requests
    assert s["goodput"]["requests_per_s"] == pytest.approx(5 / 20) and s["goodput"]["fraction"] == pytest.approx(5 / 12)
    usd = 2.0 * 4 * 20 / 3600
    assert s["cost"]["usd_per_million_output_tokens"] == pytest.approx(usd * 1e6 / 1000)
    assert s["cost"]["usd_per_million_input_tokens"] == pytest.approx(usd * 1e6 / 10000)
    assert "assumptions" in s["cost"]
    assert s["client_cpu"]["per_request_ms"] == pytest.approx(10.0)
    assert s["workers"] == {"w0": 5, "w1": 5}


def test_unreported_cache_and_no_gateway_metrics_are_null_and_said() -> None:
    s = summarize([rec(0, 0.1, 0.2, 2, cached=None)], wall_s=1.0)
    assert s["cache_hit_rate"]["total"] is None and s["cache_hit_rate"]["memory"] is None
    assert not s["cache_hit_rate"]["reported_by_server"] and "note" in s["cache_hit_rate"]
    assert s["oracle_hit_rate"] is None and s["goodput"] is None and s["cost"] is None


def test_gateway_metrics_parse_and_delta() -> None:
    text = ('# HELP dgw_prompt_tokens_total x\ndgw_prompt_tokens_total 1000.0\n'
            'dgw_cached_prompt_tokens_total{tier="memory"} 300.0\n'
            'dgw_cached_prompt_tokens_total{tier="store"} 100.0\n'
            'dgw_cached_prompt_tokens_created{tier="memory"} 1.7e9\n')
    before = gateway_metrics.parse(text)
    assert before == TierTokens(memory=300.0, store=100.0, prompt=1000.0)
    after = TierTokens(memory=500.0, store=100.0, prompt=2000.0)
    assert gateway_metrics.delta(before, after) == TierTokens(memory=200.0, store=0.0, prompt=1000.0)
    assert gateway_metrics.parse("vllm:num_requests_running 3\n") is None
