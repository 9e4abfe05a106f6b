"""Per-request records -> `summary.json` (pure: no I/O, no clock).

`summarize` is shared by the live replay (`bench`) and the offline simulator
(`simulate`): both produce `RequestRecord`s and the run's wall time, and get the same
schema (documented in docs/bench.md). Percentiles are nearest-rank (`PERCENTILE_METHOD`);
each distribution also carries mean, population std, min, max and its sample count.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from itertools import repeat
from operator import sub
from typing import Any

from deepinfer_gateway.workload.types import RequestRecord

SCHEMA_VERSION = 1
# Always in every distribution: sweeps, charts and the simulator's callers read p50/p90/p99.
PERCENTILES: tuple[float, ...] = (50, 90, 99)
PERCENTILE_METHOD = (
    "nearest-rank: the sample at 1-based rank ceil(p/100 * n) of the n samples sorted ascending "
    "(rank 1 when that is 0), always a measured value, no interpolation; numpy.percentile(method='inverted_cdf')")
STD_METHOD = "population standard deviation: sqrt(sum((x - mean)^2) / n)"
SAMPLES = {
    "ttft_s": "one per ok request that produced output: send -> first chunk carrying output",
    "itl_s": "every gap between consecutive output chunks of every ok request, pooled",
    "tpot_s": "one per ok request with >= 2 output tokens: (e2e - ttft) / (output_tokens - 1)",
    "e2e_s": "one per ok request: send -> end of stream",
    "per_user_output_tokens_per_s": "1 / tpot_s, one per ok request with a positive tpot",
    "send_lag_s": "one per sent request (open loop): actual minus scheduled send time",
}


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


def percentile_key(p: float) -> str:
    """The summary key of a percentile: 50 -> `p50`, 99.9 -> `p99.9`."""
    return f"p{p:g}"


def parse_percentiles(text: str) -> tuple[float, ...]:
    """`50,90,95,99` -> (50.0, 90.0, 95.0, 99.0), sorted and deduplicated; ValueError names a bad value."""
    values: set[float] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            value = float(part)
        except ValueError:
            raise ValueError(f"not a number: {part!r}") from None
        if not 0 <= value <= 100:
            raise ValueError(f"{part} is outside 0..100")
        values.add(value)
    if not values:
        raise ValueError("no percentile given")
    return tuple(sorted(values))


def percentile(values: Sequence[float], p: float) -> float | None:
    """Nearest-rank percentile (p in 0..100) of unsorted values; None when empty."""
    return _nearest_rank(sorted(values), p)


def _nearest_rank(ordered: Sequence[float], p: float) -> float | None:
    if not ordered:
        return None
    # Exact rational arithmetic: p/100 * n in floats can land just above an integer
    # (7/100 * 100 = 7.000000000000001) and pick the next rank.
    rank = max(1, math.ceil(Fraction(str(p)) * len(ordered) / 100))
    return ordered[rank - 1]


def distribution(values: Iterable[float], percentiles: Sequence[float] = PERCENTILES) -> dict[str, float | None]:
    """Percentiles (those given and always `PERCENTILES`), mean, std, min, max, count."""
    ordered = sorted(values)
    n = len(ordered)
    out: dict[str, float | None] = {
        percentile_key(p): _nearest_rank(ordered, p) for p in sorted({*PERCENTILES, *percentiles})}
    mean = math.fsum(ordered) / n if n else None
    out["mean"] = mean
    # (x - mean) ** 2 per value, in C: a simulated run's ITLs are millions of values.
    out["std"] = (math.sqrt(math.fsum(map(pow, map(sub, ordered, repeat(mean)), repeat(2))) / n)
                  if mean is not None else None)
    out["min"] = ordered[0] if n else None
    out["max"] = ordered[-1] if n else None
    out["count"] = n
    return out


def statistics(percentiles: Sequence[float]) -> dict[str, Any]:
    """How the distributions were computed: written into summary.json beside them."""
    return {
        "percentiles": list(percentiles),
        "keys": [percentile_key(p) for p in sorted({*PERCENTILES, *percentiles})],
        "percentile_method": PERCENTILE_METHOD,
        "std_method": STD_METHOD,
        "samples": SAMPLES,
    }


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
        out["tier_note"] = ("per-tier figures need a DeepInfer Gateway /metrics endpoint "
                            "(dgw_cached_prompt_tokens_total)")
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
    percentiles: Sequence[float] = PERCENTILES,
) -> dict[str, Any]:
    """The summary.json object. `wall_s`: first request sent to last response done;
    `percentiles`: those to report (`PERCENTILES` are always computed too)."""
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
        "statistics": statistics(percentiles),
        "ttft_s": distribution([r.ttft_s for r in ok if r.ttft_s is not None], percentiles),
        "itl_s": distribution([g for r in ok for g in r.itl_s], percentiles),
        "tpot_s": distribution(tpots, percentiles),
        "e2e_s": distribution([r.e2e_s for r in ok if r.e2e_s is not None], percentiles),
        "per_user_output_tokens_per_s": distribution([1 / t for t in tpots if t > 0], percentiles),
        "send_lag_s": distribution([r.send_lag_s for r in records if r.send_lag_s is not None], percentiles),
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


def session_figures(records: Sequence[RequestRecord], makespans_s: Sequence[float], service_s: Sequence[float],
                    percentiles: Sequence[float] = PERCENTILES) -> dict[str, Any]:
    """Closed-loop session figures, merged into summary.json by a session replay.

    follow_up_hit_rate: cached / prompt tokens over the rounds after a session's first;
    planned_hit_rate: what a perfect cache would serve them (each round's parent context,
    its prompt plus its answer unless the answer began with reasoning, which chat templates
    drop from later turns; at most the round's prompt); session_makespan_s: per session,
    first send to last answer without the tool waits on that path (`_with_waits_s`: with them)."""
    ok = [r for r in records if r.ok and r.round_idx is not None]
    follow = [r for r in ok if r.round_idx]
    prompt = sum(r.prompt_tokens or 0 for r in follow)
    cached = sum(r.cached_tokens or 0 for r in follow)
    planned = sum(min(r.planned_cached_tokens or 0, r.prompt_tokens or 0) for r in follow)
    rounds: dict[int, list[RequestRecord]] = {}
    for r in ok:
        rounds.setdefault(r.round_idx or 0, []).append(r)
    by_round = {
        str(i): {
            "requests": len(group),
            "ttft_s": distribution([r.ttft_s for r in group if r.ttft_s is not None], percentiles),
            "itl_s": distribution([g for r in group for g in r.itl_s], percentiles),
            "hit_rate": _ratio(sum(r.cached_tokens or 0 for r in group), sum(r.prompt_tokens or 0 for r in group)),
            "planned_hit_rate": _ratio(sum(min(r.planned_cached_tokens or 0, r.prompt_tokens or 0) for r in group),
                                       sum(r.prompt_tokens or 0 for r in group)),
        }
        for i, group in sorted(rounds.items())
    }
    hit, plan = _ratio(cached, prompt), _ratio(planned, prompt)
    return {
        "sessions": len(makespans_s),
        "follow_up_hit_rate": hit,
        "planned_hit_rate": plan,
        "follow_up_vs_planned": _ratio(hit, plan) if hit is not None and plan else None,
        "session_makespan_s": distribution(service_s, percentiles),
        "session_makespan_with_waits_s": distribution(makespans_s, percentiles),
        "ttft_by_round": by_round,
    }
