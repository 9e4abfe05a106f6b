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
import tempfile
import time
from pathlib import Path

import aiohttp

from deepinfer_gateway.launch import CLI, Gateway, Proc, free_port, wait_for_port

MODEL = "DeepSeek-V4.1-Flash"


def _body(i: int) -> bytes:
    return json.dumps({
        "model": MODEL, "max_tokens": 8, "thinking": {"type": "disabled"},
        "messages": [{"role": "user", "content": f"Say hello to user {i}."}],
    }).encode()


async def _load(url: str, n: int, concurrency: int) -> tuple[list[float], float, int]:
    latencies: list[float] = []
    errors = 0
    next_index = iter(range(n))
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        async def one_client() -> None:
            nonlocal errors
            for i in next_index:
                started = time.perf_counter()
                async with session.post(url, data=_body(i), headers={"content-type": "application/json"}) as r:
                    await r.read()
                    if r.status != 200:
                        errors += 1
                latencies.append(time.perf_counter() - started)

        started = time.perf_counter()
        await asyncio.gather(*(one_client() for _ in range(concurrency)))
        wall = time.perf_counter() - started
    return latencies, n / wall, errors


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    port = free_port()
    worker = Proc(CLI + ["worker", "--engine", "sim", "--port", str(port), "--time-scale", "1000"])
    gateway = None
    try:
        wait_for_port(port, timeout=30)
        worker_url = f"http://127.0.0.1:{port}"
        gateway = Gateway(Path(tempfile.mkdtemp()), [(worker_url, "unified", "sm100")])
        gateway.wait_ready(1)
        targets = {"direct": worker_url + "/v1/chat/completions", "gateway": gateway.url + "/v1/chat/completions"}
        asyncio.run(_load(targets["gateway"], 100, args.concurrency))  # warm both paths
        results: dict[str, list[tuple[float, float, float]]] = {"direct": [], "gateway": []}
        for round_no in range(args.rounds):
            for name, url in targets.items():
                lat, rps, errors = asyncio.run(_load(url, args.requests, args.concurrency))
                if errors:
                    raise SystemExit(f"{name}: {errors} failed requests")
                results[name].append((_pct(lat, 0.5), _pct(lat, 0.99), rps))
                print(f"round {round_no} {name:8s} p50 {_pct(lat, .5):7.2f} ms  p99 {_pct(lat, .99):7.2f} ms"
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
