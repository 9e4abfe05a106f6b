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
import json

from _harness import compare_non_streaming

KEYS = ("direct_p50_ms", "direct_p99_ms", "direct_rps", "gateway_p50_ms", "gateway_p99_ms", "gateway_rps",
        "added_p50_ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    figures = compare_non_streaming(args.requests, args.concurrency, args.rounds, warmup=100)
    print(json.dumps({k: figures[k] for k in KEYS}))


if __name__ == "__main__":
    main()
