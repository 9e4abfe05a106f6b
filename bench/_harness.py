"""Shared helpers of the gateway benchmarks (overhead.py, gateway_capacity.py,
relay_under_prep.py): request bodies, the closed-loop non-streaming load generator,
percentiles, flat-decode sim profiles, and starting a sim worker + gateway."""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import tempfile
import time
from importlib import resources
from pathlib import Path

import aiohttp

sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # harness/, at the repository root
from deepinfer_gateway.core.protocol import DEFAULT_MODEL
from harness.launch import CLI, Gateway, Proc, free_port, wait_for_port

MODEL = DEFAULT_MODEL


def chat_body(i: int, max_tokens: int = 8, **extra: object) -> bytes:
    return json.dumps({
        "model": MODEL, "max_tokens": max_tokens, "thinking": {"type": "disabled"},
        "messages": [{"role": "user", "content": f"Say hello to user {i}."}], **extra,
    }).encode()


async def closed_loop(url: str, n: int, concurrency: int) -> tuple[list[float], float, int]:
    """`concurrency` clients send `n` non-streaming requests back to back: (latencies s, req/s, errors)."""
    latencies: list[float] = []
    errors = 0
    next_index = iter(range(n))
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        async def one_client() -> None:
            nonlocal errors
            for i in next_index:
                started = time.perf_counter()
                async with session.post(url, data=chat_body(i), headers={"content-type": "application/json"}) as r:
                    await r.read()
                    if r.status != 200:
                        errors += 1
                latencies.append(time.perf_counter() - started)

        started = time.perf_counter()
        await asyncio.gather(*(one_client() for _ in range(concurrency)))
        wall = time.perf_counter() - started
    return latencies, n / wall, errors


def pct_ms(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


def flat_decode_profiles(tokens_per_s: float, nextn: int = 0) -> str:
    """The packaged sim profiles with every decode curve flat at `tokens_per_s` per user,
    whatever the batch: a TOML path for `worker --profiles`. `nextn`: draft tokens per decode
    step (0: one token per step, one worker message per token; the packaged profile's
    acceptance otherwise: 3 gives DeepInfer's DSpark sweep, 3.25 tokens per step on average)."""
    text = resources.files("deepinfer_gateway").joinpath("workers/sim/profiles.toml").read_text()
    flat = f"decode_points = [[1, {tokens_per_s}], [1024, {tokens_per_s}]]"
    lines = [flat if line.startswith("decode_points") else f"nextn = {nextn}" if line.startswith("nextn =")
             else line for line in text.splitlines()]
    path = Path(tempfile.mkdtemp()) / "flat-decode.toml"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def start_worker(time_scale: float, profiles: str | None = None) -> tuple[Proc, str]:
    port = free_port()
    cmd = CLI + ["worker", "--engine", "sim", "--port", str(port), "--time-scale", str(time_scale)]
    if profiles:
        cmd += ["--profiles", profiles]
    worker = Proc(cmd)
    wait_for_port(port, timeout=30)
    return worker, f"http://127.0.0.1:{port}"


def start_gateway(worker_url: str, extra_toml: str = "") -> Gateway:
    gateway = Gateway(Path(tempfile.mkdtemp()), [(worker_url, "unified", "sm100")], extra_toml=extra_toml)
    gateway.wait_ready(1)
    return gateway


def compare_non_streaming(requests: int, concurrency: int, rounds: int, warmup: int = 200) -> dict[str, float]:
    """The same short non-streaming requests directly to one instant sim worker and through a
    gateway to it, rounds alternating so machine noise hits both; medians over rounds."""
    worker, worker_url = start_worker(1000)
    gateway = None
    results: dict[str, list[tuple[float, float, float]]] = {"direct": [], "gateway": []}
    try:
        gateway = start_gateway(worker_url)
        targets = {"direct": worker_url + "/v1/chat/completions", "gateway": gateway.url + "/v1/chat/completions"}
        for url in targets.values():
            asyncio.run(closed_loop(url, warmup, concurrency))
        for round_no in range(rounds):
            for name, url in targets.items():
                lat, rps, errors = asyncio.run(closed_loop(url, requests, concurrency))
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

    out = {f"{name}_{key}": med(name, i) for name in results for i, key in enumerate(("p50_ms", "p99_ms", "rps"))}
    out["added_p50_ms"] = round(out["gateway_p50_ms"] - out["direct_p50_ms"], 2)
    out["added_p99_ms"] = round(out["gateway_p99_ms"] - out["direct_p99_ms"], 2)
    return out
