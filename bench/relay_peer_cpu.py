"""CPU per relayed chunk: this gateway against sglang-router, relaying the same streams.

    python bench/relay_peer_cpu.py [--streams 100] [--seconds 6] [--rounds 3] [--nextn 0]
        [--toml 'worker_protocol = "auto"']

One sim worker decoding at 50 tokens/s per stream (`--nextn` draft tokens per step: 0 is one
token per step and per chunk; 3 is DSpark's sweep, ~3.25), in front of it the gateway
(`--toml` its settings) and sglang-router 0.3.2 (bench/peer_venvs.py, `--policy
round_robin`: one worker, nothing to choose; it proxies the worker's OpenAI endpoint). Each
round runs `--streams` concurrent streams of `--seconds` through each router in turn
(gateway_capacity.py's client), and takes the router's process-tree CPU over the round
minus its idle rate x the round's wall time: `*_cpu_us_per_chunk` and `*_cpu_us_per_token`
(per content chunk and per output token the clients received; per-request work included,
alike for both), medians over rounds with the rounds listed, and `gateway_vs_sglang_router`.
The gateway parses, detokenizes and re-frames every step (deepseek-recipe); sglang-router
passes the worker's SSE bytes through, so this is the price of the gateway's relay against a
byte-forwarding proxy in Rust, both paying the same kernel writes.

Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # harness/, at the repository root
from _harness import flat_decode_profiles, start_worker
from gateway_capacity import TOKENS_PER_S, start_gateway, streams, tree_cpu_s
from peer_venvs import SGLANG_ROUTER, ensure_venv
from peers import peer_command

from harness.launch import free_port, wait_for_port


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--streams", type=int, default=100)
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--nextn", type=int, default=0)
    parser.add_argument("--toml", default='worker_protocol = "auto"\n')
    args = parser.parse_args()

    worker, worker_url = start_worker(1.0, flat_decode_profiles(TOKENS_PER_S, args.nextn))
    gateway = start_gateway(worker_url, extra_toml="between_events_timeout_s = 30\n" + args.toml + "\n")
    port = free_port()
    venv = ensure_venv(SGLANG_ROUTER)
    router = subprocess.Popen(peer_command("round-robin", venv, port, [worker_url]),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    targets = {"gateway": (gateway.url, gateway.proc.proc.pid),
               "sglang_router": (f"http://127.0.0.1:{port}", router.pid)}
    per_chunk: dict[str, list[float]] = {name: [] for name in targets}
    per_token: dict[str, list[float]] = {name: [] for name in targets}
    idle: dict[str, float] = {}
    try:
        wait_for_port(port, timeout=60)
        for name, (url, pid) in targets.items():
            asyncio.run(streams(url + "/v1/chat/completions", 10, 1.0))  # warm
            cpu0 = tree_cpu_s(pid)
            time.sleep(2.0)
            idle[name] = (tree_cpu_s(pid) - cpu0) / 2.0
        for round_no in range(args.rounds):
            for name, (url, pid) in targets.items():
                cpu0, wall0 = tree_cpu_s(pid), time.perf_counter()
                _, _, errors, chunks, tokens = asyncio.run(streams(url + "/v1/chat/completions", args.streams,
                                                                   args.seconds))
                cpu, wall = tree_cpu_s(pid) - cpu0, time.perf_counter() - wall0
                if errors or not chunks:
                    raise SystemExit(f"{name}: {errors} failed streams, {chunks} chunks")
                net = cpu - idle[name] * wall
                per_chunk[name].append(1e6 * net / chunks)
                per_token[name].append(1e6 * net / tokens)
                print(f"round {round_no} {name:14s} {tokens} tokens in {chunks} chunks  cpu {cpu:.2f} s"
                      f"  {1e6 * net / chunks:.1f} us/chunk  {1e6 * net / tokens:.1f} us/token", flush=True)
    finally:
        router.terminate()
        router.wait(timeout=10)
        gateway.stop()
        worker.stop()
    out: dict[str, object] = {"nextn": args.nextn, "streams": args.streams, "loadavg_1m": round(os.getloadavg()[0], 2)}
    for name in targets:
        out[f"{name}_cpu_us_per_chunk"] = round(statistics.median(per_chunk[name]), 1)
        out[f"{name}_cpu_us_per_chunk_rounds"] = [round(x, 1) for x in per_chunk[name]]
        out[f"{name}_cpu_us_per_token"] = round(statistics.median(per_token[name]), 1)
        out[f"{name}_idle_cpu_ms_per_s"] = round(1000 * idle[name], 1)
    out["gateway_vs_sglang_router"] = round(statistics.median(per_chunk["gateway"]) /
                                            statistics.median(per_chunk["sglang_router"]), 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
