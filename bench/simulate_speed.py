"""Simulator speed: the conversation trace's first half hour (5606 requests) on the 128-worker PD cluster.

    python bench/simulate_speed.py [--cluster bench/clusters/pd-128.toml] [--trace FILE] [--max-requests N]

Prints a few lines, then ONE JSON object on the last line with `requests`, `workers`,
`wall_s`, `events_per_s` (events = engine steps + arrivals + hand-offs + ticks; steady
decode stretches are simulated in one go but each step still counts as an event),
plus `cpu_s`, `steps`, `heap_events`, and the run's TTFT p50 and hit rate.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from deepinfer_gateway.simulate import load_cluster, run_simulation
from deepinfer_gateway.workload.traces import load_trace

ROOT = Path(__file__).resolve().parent.parent
TRACE = "mooncake:conversation"  # downloaded once into the cache (docs/bench.md)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cluster", default=str(ROOT / "bench" / "clusters" / "pd-128.toml"))
    parser.add_argument("--trace", default=TRACE)
    parser.add_argument("--max-requests", type=int, default=5606,
                        help="first N requests (5606: the conversation trace's first half hour)")
    args = parser.parse_args()
    config = load_cluster(args.cluster)
    trace = load_trace(args.trace).head(args.max_requests)
    wall0, cpu0 = time.perf_counter(), time.process_time()
    _, summary = run_simulation(config, trace)
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    sim = summary["simulation"]
    print(f"{len(trace.requests)} requests on {config.worker_count} workers: {wall:.1f} s wall, {cpu:.1f} s CPU, "
          f"{sim['events']} events ({sim['steps']} engine steps), {sim['virtual_s']:.0f} s simulated")
    print(json.dumps({
        "requests": len(trace.requests), "workers": config.worker_count, "wall_s": round(wall, 2),
        "events_per_s": round(sim["events"] / wall), "cpu_s": round(cpu, 2), "events": sim["events"],
        "steps": sim["steps"], "heap_events": sim["heap_events"], "virtual_s": sim["virtual_s"],
        "ttft_p50_s": summary["ttft_s"]["p50"], "hit_rate": summary["cache_hit_rate"]["total"],
        "oracle_hit_rate": summary["oracle_hit_rate"], "modes": sim["modes"],
    }))


if __name__ == "__main__":
    main()
