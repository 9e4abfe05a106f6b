"""Per-request records -> `summary.json` (pure: no I/O, no clock).

`summarize` is shared by the live replay (`bench`) and the offline simulator
(`simulate`): both produce `RequestRecord`s and the run's wall time, and get the same
schema (documented in docs/bench.md). Percentiles are nearest-rank.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from deepinfer_gateway.bench.types import RequestRecord

SCHEMA_VERSION = 1
PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class Slo:
    ttft_s: float | None = None
    tpot_s: float | None = None

    def met(self, record: RequestRecord) -> bool:
        if not record.ok:
            return False
        if self.ttft_s is not None and (record.ttft_s is None or record.ttft_s > self.ttft_s):
            return False
        tpot = record.tpot_s
        return self.tpot_s is None or tpot is None or tpot <= self.tpot_s


@dataclass(frozen=True)
class CostModel:
    """The target's GPU count (per-GPU throughput) and, optionally, its hourly price per GPU."""

    gpus: int
    gpu_hour_usd: float | None = None


@dataclass(frozen=True)
class TierTokens:
    """Per-tier cached prompt tokens over the run, from the gateway's /metrics deltas."""

    memory: float
    store: float
    prompt: float


def percentile(values: Sequence[float], p: float) -> float | None:
    """Nearest-rank percentile (p in 0..100) of unsorted values; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(p / 100 * len(ordered)))
    return ordered[rank - 1]


def distribution(values: Sequence[float]) -> dict[str, float | None]:
    ordered = sorted(values)
    out: dict[str, float | None] = {f"p{p}": percentile(ordered, p) for p in PERCENTILES}
    out["mean"] = sum(ordered) / len(ordered) if ordered else None
    out["count"] = len(ordered)
    return out


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def hit_rate_over_time(records: Sequence[RequestRecord], window_s: float) -> list[dict[str, Any]]:
    """Token-weighted reported hit rate per arrival window (requests that reported cached tokens)."""
    buckets: dict[int, list[int]] = {}
    for r in records:
        if r.ok and r.cached_tokens is not None and r.prompt_tokens:
            b = buckets.setdefault(int(r.arrival_s // window_s), [0, 0, 0])
            b[0] += r.cached_tokens
            b[1] += r.prompt_tokens
            b[2] += 1
    return [{"t_s": k * window_s, "requests": v[2], "hit_rate": _ratio(v[0], v[1])} for k, v in sorted(buckets.items())]


def _cache(records: Sequence[RequestRecord], tiers: TierTokens | None, window_s: float) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    reporting = [r for r in ok if r.cached_tokens is not None and r.prompt_tokens is not None]
    cached = sum(r.cached_tokens or 0 for r in reporting)
    prompt = sum(r.prompt_tokens or 0 for r in reporting)
    out: dict[str, Any] = {
        "total": _ratio(cached, prompt) if reporting else None,
        "memory": _ratio(tiers.memory, tiers.prompt) if tiers else None,
        "store": _ratio(tiers.store, tiers.prompt) if tiers else None,
        "reported_by_server": bool(reporting),
        "requests_reporting": len(reporting),
        "over_time": hit_rate_over_time(records, window_s),
        "window_s": window_s,
    }
    if not reporting:
        out["note"] = "the server reported no cached-token counts in usage; total hit rate unknown"
    if tiers is None:
        out["tier_note"] = "per-tier figures need a DeepInfer Gateway /metrics endpoint (dgw_cached_prompt_tokens_total)"
    return out


def _cost(cost: CostModel | None, wall_s: float, input_tokens: int, output_tokens: int) -> dict[str, Any] | None:
    if cost is None or cost.gpu_hour_usd is None:
        return None
    usd = cost.gpu_hour_usd * cost.gpus * wall_s / 3600
    return {
        "gpu_hour_usd": cost.gpu_hour_usd,
        "gpus": cost.gpus,
        "usd_total": usd,
        "usd_per_million_input_tokens": _ratio(usd * 1e6, input_tokens),
        "usd_per_million_output_tokens": _ratio(usd * 1e6, output_tokens),
        "assumptions": (
            "all GPUs are billed at gpu_hour_usd for the whole measured wall time and serve only this "
            "run (utilization as measured, idle time included); each per-token figure charges the whole "
            "cost to that token kind alone (no prefill/decode split); input tokens are prompt tokens as "
            "reported by the server; energy, CPU, network and storage are not counted"
        ),
    }


def summarize(
    records: Sequence[RequestRecord],
    *,
    wall_s: float,
    oracle_hit_rate: float | None = None,
    slo: Slo | None = None,
    cost: CostModel | None = None,
    tiers: TierTokens | None = None,
    client_cpu_s: float | None = None,
    synthesis_cpu_s: float | None = None,
    hit_window_s: float | None = None,
    meta: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The summary.json object. `wall_s`: first request sent to last response done."""
    ok = [r for r in records if r.ok]
    errors = Counter(r.error or "unknown" for r in records if not r.ok)
    prompt_tokens = sum(r.prompt_tokens or 0 for r in ok)
    output_tokens = sum(r.output_tokens or 0 for r in ok)
    tpots = [t for r in ok if (t := r.tpot_s) is not None]
    window = hit_window_s or max(1.0, wall_s / 20)
    summary: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        **(meta or {}),
        "requests": len(records),
        "completed": len(ok),
        "errors": dict(sorted(errors.items())),
        "wall_s": wall_s,
        "ttft_s": distribution([r.ttft_s for r in ok if r.ttft_s is not None]),
        "itl_s": distribution([g for r in ok for g in r.itl_s]),
        "tpot_s": distribution(tpots),
        "e2e_s": distribution([r.e2e_s for r in ok if r.e2e_s is not None]),
        "per_user_output_tokens_per_s": distribution([1 / t for t in tpots if t > 0]),
        "send_lag_s": distribution([r.send_lag_s for r in records if r.send_lag_s is not None]),
        "throughput": {
            "requests_per_s": _ratio(len(ok), wall_s),
            "output_tokens_per_s": _ratio(output_tokens, wall_s),
            "input_tokens_per_s": _ratio(prompt_tokens, wall_s),
            "output_tokens_per_s_per_gpu": _ratio(output_tokens, wall_s * cost.gpus) if cost else None,
        },
        "tokens": {
            "prompt": prompt_tokens,
            "cached": sum(r.cached_tokens or 0 for r in ok),
            "output": output_tokens,
            "expected_input": sum(r.expected_input_tokens or 0 for r in records),
            "expected_output": sum(r.expected_output_tokens or 0 for r in records),
        },
        "cache_hit_rate": _cache(records, tiers, window),
        "oracle_hit_rate": oracle_hit_rate,
        "goodput": None,
        "cost": _cost(cost, wall_s, prompt_tokens, output_tokens),
        "workers": dict(sorted(Counter(r.worker for r in ok if r.worker).items())),
        "client_cpu": None,
    }
    if slo is not None and (slo.ttft_s is not None or slo.tpot_s is not None):
        good = [r for r in records if slo.met(r)]
        summary["goodput"] = {
            "slo_ttft_s": slo.ttft_s,
            "slo_tpot_s": slo.tpot_s,
            "requests_per_s": _ratio(len(good), wall_s),
            "output_tokens_per_s": _ratio(sum(r.output_tokens or 0 for r in good), wall_s),
            "fraction": _ratio(len(good), len(records)),
        }
    if client_cpu_s is not None:
        summary["client_cpu"] = {
            "total_s": client_cpu_s,
            "per_request_ms": _ratio(client_cpu_s * 1e3, len(records)),
            "cores_used": _ratio(client_cpu_s, wall_s),
            "prompt_synthesis_s": synthesis_cpu_s,
            "measured_with": "time.process_time over the replay (all threads of the bench process)",
        }
    return summary
