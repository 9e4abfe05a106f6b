"""What the slow tail's routing decisions were, from a gateway decision trace.

    python bench/decision_report.py DIR/gateway/decisions.jsonl [--time-scale 0.25] [--tail 0.02]

Reads the JSON lines the gateway writes with `router.decision_log` (bench/peers.py
--decision-trace puts them next to results.jsonl). Times in the trace are wall seconds; the
policy's estimates are simulated seconds, so `--time-scale` (peers.py's, default 0.25)
converts wall to simulated. Prints:
- per worker: requests, reasons, predicted vs reported cached tokens (the index against the
  engine), median and p99 time to the first token, estimated vs actual for the chosen worker,
  and the queue it was chosen with: the load report's part, the gateway's bookings, the
  report's age (medians; traces that carry them);
- the slowest `--tail` share of requests: when, where, why, the queue the router saw on each
  candidate, the model's own best candidate (lowest estimate) when it differs from the chosen
  one (stickiness or the load guard overrode it), and the gateway's loop stall meanwhile;
- whether the tail is bunched in time (several workers at once: something shared) or spread.
The last line is one JSON object with the per-worker figures and the tail's counts.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import Counter
from pathlib import Path
from typing import Any


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def per_worker(records: list[dict[str, Any]], time_scale: float) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for worker in sorted({r["worker"] for r in records}):
        mine = [r for r in records if r["worker"] == worker]
        first = [r["first_token_s"] * time_scale for r in mine]
        errors = []
        booked, reported, ages = [], [], []
        for r in mine:
            chosen: dict[str, Any] = next((c for c in r["candidates"] if c["worker"] == worker), {})
            est = chosen.get("estimate_s")
            if est is not None:
                errors.append(r["first_token_s"] * time_scale - est)
            if "booked_tokens" in chosen:  # traces of older gateways lack the queue's parts
                booked.append(chosen["booked_tokens"])
                ages.append(chosen["load_age_s"] * time_scale)
                if chosen["reported_tokens"] is not None:
                    reported.append(chosen["reported_tokens"])
        out[worker] = {
            "requests": len(mine),
            "reasons": dict(Counter(r["reason"] for r in mine)),
            "predicted_cached_tokens": sum(r["predicted"]["memory"] + r["predicted"]["store"] for r in mine),
            "reported_cached_tokens": sum(r["reported"]["memory"] + r["reported"]["store"] for r in mine),
            "prompt_tokens": sum(r["prompt_tokens"] for r in mine),
            "first_token_p50_s": _round(statistics.median(first)),
            "first_token_p99_s": _round(_pct(first, 0.99)),
            "actual_minus_estimate_median_s": _round(statistics.median(errors)) if errors else None,
            # the chosen worker's queue at decision time: the load report's part, the bookings', the report's age
            "reported_queue_median_tokens": statistics.median(reported) if reported else None,
            "booked_queue_median_tokens": statistics.median(booked) if booked else None,
            "load_age_median_s": _round(statistics.median(ages)) if ages else None,
        }
    return out


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def _crowd(candidate: dict[str, Any]) -> str:
    """The requests lockstep pricing saw on the candidate (traces of older gateways lack them)."""
    parts = []
    if candidate.get("admitting"):
        parts.append(f"a{candidate['admitting']}:{candidate['admitting_tokens']}")
    if candidate.get("prefilling_max"):
        parts.append(f"p{candidate['prefilling_max']}@{candidate['prefilling_age_s']}")
    return f"[{' '.join(parts)}]" if parts else ""


def tail(records: list[dict[str, Any]], share: float) -> list[dict[str, Any]]:
    n = max(1, round(share * len(records)))
    return sorted(records, key=lambda r: r["first_token_s"], reverse=True)[:n]


def model_best(record: dict[str, Any]) -> str | None:
    estimated = [c for c in record["candidates"] if c["estimate_s"] is not None]
    return min(estimated, key=lambda c: (c["estimate_s"], c["worker"]))["worker"] if estimated else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace", type=Path)
    parser.add_argument("--time-scale", type=float, default=0.25, help="simulated / wall seconds (default 0.25)")
    parser.add_argument("--tail", type=float, default=0.02, help="share of slowest requests shown (default 0.02)")
    args = parser.parse_args()
    records = [json.loads(line) for line in args.trace.read_text().splitlines() if line.strip()]
    if not records:
        raise SystemExit(f"{args.trace} holds no decisions")
    T = args.time_scale
    t0 = min(r["t"] - r["first_token_s"] for r in records)
    workers = per_worker(records, T)
    print(f"{len(records)} decisions; times in simulated seconds (wall x {T})")
    print(f"{'worker':22s}{'reqs':>6s}{'pred cached':>13s}{'reported':>11s}{'hit':>7s}{'p50':>8s}{'p99':>8s}"
          f"{'act-est':>9s}  reasons")
    for worker, w in workers.items():
        hit = w["reported_cached_tokens"] / max(1, w["prompt_tokens"])
        print(f"{worker:22s}{w['requests']:6d}{w['predicted_cached_tokens']:13d}{w['reported_cached_tokens']:11d}"
              f"{hit:7.3f}{w['first_token_p50_s']!s:>8s}{w['first_token_p99_s']!s:>8s}"
              f"{w['actual_minus_estimate_median_s']!s:>9s}  {w['reasons']}  queue reported/booked "
              f"{w['reported_queue_median_tokens']}/{w['booked_queue_median_tokens']} age {w['load_age_median_s']}")
    slow = tail(records, args.tail)
    print(f"\nslowest {len(slow)}: arrival (s since the first), worker, reason, prompt, predicted/reported cached, "
          f"queue, first token, gateway loop stall; candidates: worker hit/queued tokens/estimate "
          f"[admitting n:tokens, prefilling largest@age s]")
    overridden = 0
    for r in sorted(slow, key=lambda r: r["t"] - r["first_token_s"]):
        best = model_best(r)
        overridden += best is not None and best != r["worker"]
        cands = " ".join(f"{c['worker'].rsplit(':', 1)[-1]}:{c['hit_tokens']}/{c['queued_tokens']}/"
                         f"{'-' if c['estimate_s'] is None else round(c['estimate_s'], 2)}{_crowd(c)}"
                         for c in r["candidates"])
        print(f"{(r['t'] - r['first_token_s'] - t0) * T:8.2f} {r['worker'].rsplit(':', 1)[-1]:>6s} {r['reason']:16s}"
              f"{r['prompt_tokens']:7d} {r['predicted']['memory']}/{r['reported']['memory']:<7d}"
              f" q {r['queue_s'] * T:6.2f} ft {r['first_token_s'] * T:6.2f} stall {r['loop_stall_s'] * T:5.2f}"
              f"{'' if best in (None, r['worker']) else ' model-best ' + best.rsplit(':', 1)[-1]}  {cands}")
    arrivals = sorted((r["t"] - r["first_token_s"] - t0) * T for r in slow)
    window = (arrivals[-1] - arrivals[0]) if arrivals else 0.0
    tail_workers = Counter(r["worker"] for r in slow)
    print(f"\ntail arrivals span {window:.2f} s over {len(tail_workers)} workers {dict(tail_workers)}; "
          f"{overridden} of {len(slow)} went elsewhere than the model's lowest estimate; "
          f"median gateway loop stall in the tail {statistics.median(r['loop_stall_s'] for r in slow) * T:.3f} s")
    print(json.dumps({"decisions": len(records), "workers": workers, "tail": len(slow),
                      "tail_span_s": round(window, 3), "tail_workers": dict(tail_workers),
                      "tail_overridden": overridden}))


if __name__ == "__main__":
    main()
