"""bench/repeat_stats.py: medians and spreads of repeated runs, ratios with a bootstrap interval."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_PATH = Path(__file__).resolve().parents[2] / "bench" / "repeat_stats.py"
_spec = importlib.util.spec_from_file_location("repeat_stats", _PATH)
assert _spec is not None and _spec.loader is not None
repeat_stats = importlib.util.module_from_spec(_spec)
sys.modules["repeat_stats"] = repeat_stats
_spec.loader.exec_module(repeat_stats)


def test_describe_gives_median_range_and_spread() -> None:
    assert repeat_stats.describe([3.0, 1.0, 2.0, 4.0]) == {"median": 2.5, "min": 1.0, "max": 4.0, "spread": 4.0}
    assert repeat_stats.describe([]) == {"median": None, "min": None, "max": None, "spread": None}
    assert repeat_stats.describe([0.0, 1.0])["spread"] is None


def test_ratio_interval_brackets_the_ratio_and_narrows_with_agreeing_runs() -> None:
    noisy = repeat_stats.ratio_ci([1.0, 2.0, 4.0, 1.5, 3.0], [2.0, 2.1, 1.9, 2.0, 2.2])
    assert noisy["low"] <= noisy["ratio"] <= noisy["high"]
    steady = repeat_stats.ratio_ci([1.0, 1.01, 0.99, 1.0, 1.0], [2.0, 2.0, 2.02, 1.98, 2.0])
    assert steady["ratio"] == 0.5 and 0.49 <= steady["low"] <= 0.5 <= steady["high"] <= 0.51
    assert noisy["high"] - noisy["low"] > steady["high"] - steady["low"]
    assert repeat_stats.ratio_ci([1.0], []) == {"ratio": None, "low": None, "high": None}


def test_summarise_per_target_and_ratios_to_each_peer() -> None:
    rows = [{"target": "gateway", "ttft_p99_s": p99, "ttft_p90_s": 0.5, "ttft_p50_s": 0.3, "hit_rate": 0.16,
             "router_cpu_ms_per_req": 10.0} for p99 in (1.0, 1.2, 1.4)]
    rows += [{"target": "sglang-router", "ttft_p99_s": p99, "ttft_p90_s": 1.0, "ttft_p50_s": 0.3, "hit_rate": 0.15,
              "router_cpu_ms_per_req": 5.0} for p99 in (2.0, 2.4, 2.8)]
    out = repeat_stats.summarise(rows)
    gateway = out["targets"]["gateway"]
    assert gateway["runs"] == 3 and gateway["ttft_p99_s_median"] == 1.2 and gateway["ttft_p99_s_spread"] == 1.4
    assert gateway["errors_median"] is None  # a figure no run had
    ratios = out["ratios"]["gateway_vs_sglang-router"]
    assert ratios["p99"]["ratio"] == 0.5 and ratios["p90"]["ratio"] == 0.5
    assert ratios["hit"]["ratio"] == round(0.16 / 0.15, 3)
    assert ratios["router_cpu"] == {"ratio": 2.0, "low": 2.0, "high": 2.0}
    assert ratios["workers_cpu"]["ratio"] is None  # no run reported it
    assert set(out["ratios"]) == {"gateway_vs_sglang-router"}


def test_ratios_across_slices_pool_only_the_ratios() -> None:
    def slice_ratios(p99: float, p50: float | None) -> dict[str, dict[str, dict[str, float | None]]]:
        return {"gateway_vs_sglang-router": {"p99": {"ratio": p99, "low": p99, "high": p99},
                                             "p50": {"ratio": p50, "low": p50, "high": p50}}}

    out = repeat_stats.across_slices([slice_ratios(0.7, 0.9), slice_ratios(1.6, None), slice_ratios(1.1, 1.0)])
    pair = out["gateway_vs_sglang-router"]
    assert pair["p99"] == {"per_slice": [0.7, 1.6, 1.1], "median": 1.1, "low": 0.7, "high": 1.6}
    assert pair["p50"] == {"per_slice": [0.9, 1.0], "median": 0.95, "low": 0.9, "high": 1.0}  # a slice without one
    assert repeat_stats.across_slices([]) == {}
