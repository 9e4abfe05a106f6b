"""Per-event cost of the gateway's hot-path metric updates, in memory vs multiprocess mode.

    python bench/metrics_multiprocess.py [--rounds 3] [--number 20000]

Events (what the request path does): `itl_observe` (one per streamed token message:
`RequestSeries.itl.observe`), `counter_inc` (`dgw_requests_total` child), `inflight_inc_dec`
(one leg's start and end). Each mode runs in a child interpreter of its own, because
prometheus-client picks its value store at import: `memory` without
PROMETHEUS_MULTIPROC_DIR (the baseline), `multiprocess` with it set to a fresh folder.
Rounds alternate the two; each figure is the median over rounds of the best of 5 timeit
repeats, in ns per event. `scrape_ms`: one /metrics exposition in each mode after the events.

Last line: one JSON object: <event>_ns and <event>_ns_baseline, their ratio, scrape_ms.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import timeit

EVENTS = ("itl_observe", "counter_inc", "inflight_inc_dec")


def measure(number: int) -> dict[str, float]:
    """In this interpreter, as its environment set prometheus-client up."""
    from prometheus_client import generate_latest

    from deepinfer_gateway.gateway.telemetry.metrics import GatewayMetrics

    metrics = GatewayMetrics()
    series = metrics.request_series("DeepSeek-V4.1-Flash", "unified", "sm100")
    requests = metrics.requests.labels("chat", "DeepSeek-V4.1-Flash", "200")

    def inflight() -> None:
        metrics.inflight.inc()
        metrics.inflight.dec()

    calls = {"itl_observe": lambda: series.itl.observe(0.012), "counter_inc": requests.inc,
             "inflight_inc_dec": inflight}
    out = {name: min(timeit.repeat(fn, number=number, repeat=5)) / number * 1e9 for name, fn in calls.items()}
    out["scrape_ms"] = min(timeit.repeat(lambda: generate_latest(metrics.exposition), number=20, repeat=3)) / 20 * 1e3
    return out


def run_mode(multiprocess: bool, number: int) -> dict[str, float]:
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    with tempfile.TemporaryDirectory() as shared:
        if multiprocess:
            env["PROMETHEUS_MULTIPROC_DIR"] = shared
        done = subprocess.run([sys.executable, __file__, "--child", "--number", str(number)], env=env,
                              capture_output=True, text=True, check=True)
    return dict(json.loads(done.stdout.splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--number", type=int, default=20000, help="events per timeit repeat")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.number)))
        return
    runs: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    for _ in range(args.rounds):
        for multiprocess in (False, True):
            runs[multiprocess].append(run_mode(multiprocess, args.number))

    def median(multiprocess: bool, key: str) -> float:
        return statistics.median(r[key] for r in runs[multiprocess])

    result: dict[str, float] = {}
    for event in EVENTS:
        result[f"{event}_ns"] = round(median(True, event))
        result[f"{event}_ns_baseline"] = round(median(False, event))
        result[f"{event}_ratio"] = round(median(True, event) / median(False, event), 2)
    result["scrape_ms"] = round(median(True, "scrape_ms"), 2)
    result["scrape_ms_baseline"] = round(median(False, "scrape_ms"), 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
