"""Bench client capacity: does `deepinfer-gateway bench` hold 200+ concurrent streams on at
most one core, and what does its bookkeeping cost over a bare streaming client?

    python bench/client_capacity.py [--concurrency 200] [--seconds 30] [--tokens-per-s 10]

Starts one sim worker (flat decode at --tokens-per-s per stream, so the 2-core machine's
gateway and worker keep up) behind a gateway, then, in one run:
1. the bench client: `run_bench` (OpenAI SDK, streaming, per-token timing, results.jsonl),
   closed loop at --concurrency for --seconds on a Mooncake-format trace of distinct
   2,400-token prompts with 100-token answers;
2. baseline: a bare aiohttp SSE reader at the same concurrency and duration (no SDK, no
   records; one 2,400-word prompt, 100-token answers), the floor of what a client costs.
For each: mean streams in flight over the sending window (the first --seconds; the drain
after it is left out), CPU cores used (this process's CPU time / wall), CPU per request and
per streamed chunk (one content delta: a token here). Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

import aiohttp
from _harness import MODEL, flat_decode_profiles, start_gateway, start_worker

from deepinfer_gateway.loadgen.replay import ReplayConfig
from deepinfer_gateway.loadgen.run import BenchConfig, run_bench
from deepinfer_gateway.workload.types import read_records

PROMPT_TOKENS, OUTPUT_TOKENS = 2400, 100


def write_trace(requests: int) -> str:
    """Distinct prompts (own block ids), all due at once: the closed loop paces them."""
    blocks = -(-PROMPT_TOKENS // 512)
    path = Path(tempfile.mkdtemp()) / "trace.jsonl"
    rows = ({"timestamp": 0, "input_length": PROMPT_TOKENS, "output_length": OUTPUT_TOKENS,
             "hash_ids": list(range(i * blocks, (i + 1) * blocks))} for i in range(requests))
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def in_flight_mean(intervals: list[tuple[float, float]], seconds: float) -> float:
    """Mean number of open streams over [0, seconds] (start/end times relative to the run start)."""
    return sum(max(0.0, min(end, seconds) - max(start, 0.0)) for start, end in intervals) / seconds


def bench_client(url: str, concurrency: int, seconds: float) -> dict[str, float]:
    out = Path(tempfile.mkdtemp()) / "bench"
    replay = ReplayConfig(mode="closed", concurrency=concurrency, duration_s=seconds, progress=False)
    trace = write_trace(concurrency * int(seconds))  # more than the run can send
    summary = run_bench(BenchConfig(url=url, trace=trace, out=out, replay=replay, ignore_eos=True, plots=False))
    records = read_records(out / "results.jsonl")
    if summary["errors"]:
        raise SystemExit(f"bench client: errors {summary['errors']}")
    chunks = sum(len(r.itl_s) + 1 for r in records if r.ok)
    cpu = summary["client_cpu"]
    return {
        "requests": summary["completed"],
        "streams_in_flight_mean": in_flight_mean([(r.arrival_s, r.arrival_s + (r.e2e_s or 0)) for r in records],
                                                 seconds),
        "cores_used": cpu["cores_used"],
        "cpu_ms_per_request": cpu["per_request_ms"],
        "cpu_us_per_chunk": cpu["total_s"] / chunks * 1e6,
    }


async def bare_client(url: str, concurrency: int, seconds: float) -> dict[str, float]:
    body = json.dumps({"model": MODEL, "max_tokens": OUTPUT_TOKENS, "ignore_eos": True, "stream": True,
                       "messages": [{"role": "user", "content": "word " * PROMPT_TOKENS}]}).encode()
    chunks = 0
    intervals: list[tuple[float, float]] = []
    start = time.perf_counter()

    async def one_user(session: aiohttp.ClientSession) -> None:
        nonlocal chunks
        while time.perf_counter() < start + seconds:
            started = time.perf_counter()
            async with session.post(url + "/v1/chat/completions", data=body,
                                    headers={"content-type": "application/json"}) as r:
                if r.status != 200:
                    raise SystemExit(f"bare client: HTTP {r.status}")
                async for line in r.content:
                    if line.startswith(b"data: {"):
                        chunks += 1
            intervals.append((started - start, time.perf_counter() - start))

    cpu0 = time.process_time()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:
        await asyncio.gather(*(one_user(session) for _ in range(concurrency)))
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - start
    return {"requests": len(intervals), "streams_in_flight_mean": in_flight_mean(intervals, seconds),
            "cores_used": cpu / wall, "cpu_ms_per_request": cpu / len(intervals) * 1e3,
            "cpu_us_per_chunk": cpu / chunks * 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=200)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--tokens-per-s", type=float, default=10.0, help="sim decode speed per stream")
    args = parser.parse_args()
    worker, worker_url = start_worker(1.0, flat_decode_profiles(args.tokens_per_s))
    gateway = None
    try:
        gateway = start_gateway(worker_url)
        bench = bench_client(gateway.url, args.concurrency, args.seconds)
        bare = asyncio.run(bare_client(gateway.url, args.concurrency, args.seconds))
    finally:
        if gateway:
            gateway.stop()
        worker.stop()
    for name, row in (("bench client", bench), ("bare client", bare)):
        print(f"{name:12s} " + "  ".join(f"{k} {v:,.2f}" for k, v in row.items()), flush=True)
    print(json.dumps({
        "concurrency": args.concurrency,
        "bench_streams_in_flight_mean": round(bench["streams_in_flight_mean"], 1),
        "bench_client_cores_used": round(bench["cores_used"], 3),
        "bench_client_cpu_ms_per_request": round(bench["cpu_ms_per_request"], 2),
        "bench_client_cpu_us_per_chunk": round(bench["cpu_us_per_chunk"], 1),
        "bare_streams_in_flight_mean": round(bare["streams_in_flight_mean"], 1),
        "bare_client_cores_used": round(bare["cores_used"], 3),
        "bare_client_cpu_us_per_chunk": round(bare["cpu_us_per_chunk"], 1),
        "bench_over_bare_cpu_per_chunk": round(bench["cpu_us_per_chunk"] / bare["cpu_us_per_chunk"], 2),
    }))


if __name__ == "__main__":
    main()
