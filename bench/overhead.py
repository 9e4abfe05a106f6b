"""Gateway overhead: the same short non-streaming chat requests sent directly to one sim
worker's OpenAI endpoint and through the gateway to that same worker, side by side.

    python bench/overhead.py [--requests 1000] [--concurrency 16] [--rounds 3]

Starts its own sim worker (time scale 1000: the engine answers almost instantly, so the
figures are HTTP + conversion + relay cost) and its own gateway (`serve`). Rounds
alternate direct/gateway so machine noise hits both; medians over rounds are reported.
The last line is one JSON object: direct_p50_ms, direct_p99_ms, direct_rps, gateway_p50_ms,
gateway_p99_ms, gateway_rps, added_p50_ms.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics

from _harness import closed_loop, pct_ms, start_gateway, start_worker


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    worker, worker_url = start_worker(1000)
    gateway = None
    try:
        gateway = start_gateway(worker_url)
        targets = {"direct": worker_url + "/v1/chat/completions", "gateway": gateway.url + "/v1/chat/completions"}
        asyncio.run(closed_loop(targets["gateway"], 100, args.concurrency))  # warm both paths
        results: dict[str, list[tuple[float, float, float]]] = {"direct": [], "gateway": []}
        for round_no in range(args.rounds):
            for name, url in targets.items():
                lat, rps, errors = asyncio.run(closed_loop(url, args.requests, args.concurrency))
                if errors:
                    raise SystemExit(f"{name}: {errors} failed requests")
                results[name].append((pct_ms(lat, 0.5), pct_ms(lat, 0.99), rps))
                print(f"round {round_no} {name:8s} p50 {pct_ms(lat, .5):7.2f} ms  p99 {pct_ms(lat, .99):7.2f} ms"
                      f"  {rps:7.1f} req/s", flush=True)
    finally:
        if gateway:
            gateway.stop()
        worker.stop()

    def med(name: str, i: int) -> float:
        return round(statistics.median(r[i] for r in results[name]), 2)

    summary = {
        "direct_p50_ms": med("direct", 0), "direct_p99_ms": med("direct", 1), "direct_rps": med("direct", 2),
        "gateway_p50_ms": med("gateway", 0), "gateway_p99_ms": med("gateway", 1), "gateway_rps": med("gateway", 2),
    }
    summary["added_p50_ms"] = round(summary["gateway_p50_ms"] - summary["direct_p50_ms"], 2)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
