"""Repeated-run statistics for bench/peers.py: per-target medians and spreads, and ratios of
medians between targets with a bootstrap confidence interval. Pure functions, no I/O.

One run of an 800-request p99 is the 8th-worst request of one replay: it swings with the
machine. A claim needs several interleaved repetitions; these summarise them:
- `describe(values)`: median, min, max and spread (max / min) of one figure over the runs;
- `ratio_ci(a, b)`: median(a) / median(b) with a percentile bootstrap interval (each
  resample draws both targets' runs with replacement; seeded, so the report is stable);
- `across_slices(ratios)`: each ratio over several slices (trace parts or seeds), whose
  absolute figures differ, so only their ratios are pooled.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence
from typing import Any

FIGURES = ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "hit_rate", "errors", "router_cpu_ms_per_req",
           "workers_cpu_ms_per_req",
           "proxy_cpu_ms_per_req",  # the epp target's Envoy
           "client_send_lag_p99_s", "others_cpu_cores",
           "follow_up_hit_rate", "follow_up_vs_planned", "session_makespan_p50_s",  # these three: --sessions
           "evicted_recomputed_share")  # sim workers only
RATIO_FIGURES = {"p99": "ttft_p99_s", "p90": "ttft_p90_s", "p50": "ttft_p50_s", "hit": "hit_rate",
                 "router_cpu": "router_cpu_ms_per_req", "workers_cpu": "workers_cpu_ms_per_req"}
# Ratios given only where both targets' runs have the figure (--sessions; sim workers).
RATIO_FIGURES_WHERE_RUN = {"follow_up_hit": "follow_up_hit_rate", "makespan": "session_makespan_p50_s",
                           "evicted_recomputed": "evicted_recomputed_share"}


def describe(values: Sequence[float]) -> dict[str, float | None]:
    """Median, min, max and max/min of the runs' values (None where undefined)."""
    if not values:
        return {"median": None, "min": None, "max": None, "spread": None}
    low, high = min(values), max(values)
    return {"median": round(statistics.median(values), 4), "min": round(low, 4), "max": round(high, 4),
            "spread": round(high / low, 3) if low > 0 else None}


def ratio_ci(a: Sequence[float], b: Sequence[float], resamples: int = 2000, level: float = 0.95,
             seed: int = 0) -> dict[str, float | None]:
    """median(a) / median(b) and its percentile bootstrap interval at `level`."""
    if not a or not b or statistics.median(b) == 0:
        return {"ratio": None, "low": None, "high": None}
    rng = random.Random(seed)
    ratios: list[float] = []
    for _ in range(resamples):
        denominator = statistics.median(rng.choices(b, k=len(b)))
        if denominator > 0:
            ratios.append(statistics.median(rng.choices(a, k=len(a))) / denominator)
    ratios.sort()
    tail = (1 - level) / 2
    def pick(q: float) -> float:
        return ratios[min(len(ratios) - 1, max(0, round(q * (len(ratios) - 1))))]

    return {"ratio": round(statistics.median(a) / statistics.median(b), 3),
            "low": round(pick(tail), 3) if ratios else None, "high": round(pick(1 - tail), 3) if ratios else None}


def _values(runs: Sequence[dict[str, Any]], figure: str) -> list[float]:
    return [float(r[figure]) for r in runs if r.get(figure) is not None]


def summarise(rows: Sequence[dict[str, Any]], reference: str = "gateway") -> dict[str, Any]:
    """Per target: each figure described over its runs (keys `<figure>_median`, `_min`,
    `_max`, `_spread`); ratios of `reference` to every other target."""
    by_target: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_target.setdefault(row["target"], []).append(row)
    targets: dict[str, dict[str, Any]] = {}
    for target, runs in by_target.items():
        entry: dict[str, Any] = {"runs": len(runs)}
        for figure in FIGURES:
            for stat, value in describe(_values(runs, figure)).items():
                entry[f"{figure}_{stat}"] = value
        targets[target] = entry
    ratios: dict[str, dict[str, Any]] = {}
    if reference in by_target:
        mine = by_target[reference]
        for peer, theirs in by_target.items():
            if peer == reference:
                continue
            pair = ratios[f"{reference}_vs_{peer}"] = {
                name: ratio_ci(_values(mine, f), _values(theirs, f)) for name, f in RATIO_FIGURES.items()}
            for name, f in RATIO_FIGURES_WHERE_RUN.items():
                if (a := _values(mine, f)) and (b := _values(theirs, f)):
                    pair[name] = ratio_ci(a, b)
    return {"targets": targets, "ratios": ratios}


def across_slices(slice_ratios: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Each ratio over the slices: its per-slice values, their median, lowest and highest."""
    out: dict[str, dict[str, Any]] = {}
    for pair in slice_ratios[0] if slice_ratios else {}:
        out[pair] = {}
        for name in slice_ratios[0][pair]:
            values = [ratio for r in slice_ratios
                      if (ratio := r.get(pair, {}).get(name, {}).get("ratio")) is not None]
            out[pair][name] = {"per_slice": values, "median": round(statistics.median(values), 4) if values else None,
                               "low": min(values, default=None), "high": max(values, default=None)}
    return out
