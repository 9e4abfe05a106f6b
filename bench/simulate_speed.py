"""Simulator speed: the conversation trace's first half hour (5606 requests) on a PD cluster.

    python bench/simulate_speed.py [--workers 128|1024] [--cluster FILE] [--speedup X]
                                   [--trace FILE] [--max-requests N] [--baseline FILE]

`--workers N` picks bench/clusters/pd-N.toml (default 128); `--cluster` any cluster file.
The arrival speedup defaults to workers / 16, the same offered load per worker at every
size (pd-128: 8x, pd-1024: 64x). `--baseline FILE`: a file holding an earlier run's
output (its last JSON line is read); the run is compared with it (`vs_baseline`: wall
ratio, hit rate and TTFT p99 ratios, and whether the figures are identical).

Prints a few lines, then ONE JSON object on the last line with `requests`, `workers`,
`wall_s`, `events_per_s` (events = engine steps + arrivals + hand-offs + ticks; steady
decode stretches are simulated in one go but each step still counts as an event),
plus `cpu_s`, `steps`, `heap_events`, and the run's TTFT p50/p99 and hit rate.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from deepinfer_gateway.simulate import load_cluster, run_simulation
from deepinfer_gateway.workload.traces import load_trace

ROOT = Path(__file__).resolve().parent.parent
CLUSTERS = ROOT / "bench" / "clusters"
TRACE = "mooncake:conversation"  # downloaded once into the cache (docs/bench.md)
WORKERS_PER_SPEEDUP = 16  # default speedup = workers / 16: constant offered load per worker


def compare(result: dict[str, Any], baseline_path: str) -> dict[str, Any]:
    lines = Path(baseline_path).read_text().splitlines()
    base = json.loads(next(line for line in reversed(lines) if line.startswith("{")))
    return {
        "baseline_wall_s": base["wall_s"], "speedup_x": round(base["wall_s"] / result["wall_s"], 2),
        "hit_rate_ratio": round(result["hit_rate"] / base["hit_rate"], 4),
        "ttft_p99_ratio": round(result["ttft_p99_s"] / base["ttft_p99_s"], 4),
        "identical": all(result[k] == base[k] for k in ("hit_rate", "ttft_p50_s", "ttft_p99_s", "steps", "modes")),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=128, help="use bench/clusters/pd-N.toml")
    parser.add_argument("--cluster", default=None, help="a cluster file (overrides --workers)")
    parser.add_argument("--speedup", type=float, default=None, help="arrival speedup (default: workers / 16)")
    parser.add_argument("--trace", default=TRACE)
    parser.add_argument("--max-requests", type=int, default=5606,
                        help="first N requests (5606: the conversation trace's first half hour)")
    parser.add_argument("--baseline", default=None, help="compare with an earlier run's output")
    args = parser.parse_args()
    cluster = Path(args.cluster) if args.cluster else CLUSTERS / f"pd-{args.workers}.toml"
    if not cluster.exists():
        parser.error(f"no cluster file {cluster}")
    config = load_cluster(cluster)
    speedup = args.speedup if args.speedup is not None else config.worker_count / WORKERS_PER_SPEEDUP
    trace = load_trace(args.trace).head(args.max_requests)
    wall0, cpu0 = time.perf_counter(), time.process_time()
    _, summary = run_simulation(config, trace, speedup=speedup)
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    sim = summary["simulation"]
    print(f"{len(trace.requests)} requests on {config.worker_count} workers at {speedup:g}x: {wall:.1f} s wall, "
          f"{cpu:.1f} s CPU, {sim['events']} events ({sim['steps']} engine steps), {sim['virtual_s']:.0f} s simulated")
    result = {
        "requests": len(trace.requests), "workers": config.worker_count, "speedup": speedup, "wall_s": round(wall, 2),
        "events_per_s": round(sim["events"] / wall), "cpu_s": round(cpu, 2), "events": sim["events"],
        "steps": sim["steps"], "heap_events": sim["heap_events"], "virtual_s": sim["virtual_s"],
        "ttft_p50_s": summary["ttft_s"]["p50"], "ttft_p99_s": summary["ttft_s"]["p99"],
        "hit_rate": summary["cache_hit_rate"]["total"], "oracle_hit_rate": summary["oracle_hit_rate"],
        "modes": sim["modes"],
    }
    if args.baseline:
        result["vs_baseline"] = compare(result, args.baseline)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
