"""Gateway capacity on this machine: what the gateway adds in front of sim workers.

    python bench/gateway_capacity.py [--requests 2000] [--concurrency 16] [--rounds 3]
        [--streams 50,100,150,200,300,400] [--stream-seconds 8] [--stream-rounds 3] [--profile DIR]

Non-streaming: short chat requests to a sim worker that answers instantly (time scale
1000), directly (its OpenAI-compatible endpoint) and through the gateway, rounds
alternating; req/s and the added p50/p99 latency (medians over rounds).

Streaming: a sim worker whose profile decodes at exactly 50 tokens/s per stream at any
batch (a profile TOML override: flat decode curve, time scale 1), N concurrent streams
directly and through the gateway, in `--stream-rounds` rounds alternating the two so the
shared machine's noise hits both; inter-token latency measured at the client; each figure
is the median over rounds (the added ITL p99 is the median of the per-round differences,
listed in `added_itl_p99_ms_rounds`). The gateway sustains N when, at the same N, (1) the
direct streams themselves run at >= 90% of 50 tok/s (otherwise this machine cannot offer
that load at all; the sim steps on fixed deadlines, so direct streams get their 50 tok/s
until the cores run out), (2) the gateway's median stream gets >= 95% of the direct median
rate (the minimum over rounds is reported too), (3) its added ITL p99 (gateway p99 - direct
p99) is <= 5 ms, and (4) no gateway stream failed. `streams_sustained` is the largest such N tried (levels in order,
stopping at the first that fails).

Fairness: both sides send the same chat request with `ignore_eos`, so direct and gateway
streams are equally long (the sim's own chat endpoint ignored `ignore_eos` before, which
made the direct runs ~1 s of short streams against 8 s through the gateway). Client,
worker and gateway share the machine's 2 cores: at ~100+ streams the client and the
worker alone take most of them (see `*_cpu_us_per_event` in the levels).

`--profile DIR`: py-spy (if installed) samples the gateway during one extra
non-streaming round; the top self-time functions are printed and saved.

The last line is one JSON object: direct_rps, gateway_rps, added_p50_ms, added_p99_ms,
streams_sustained, stream_added_itl_p99_ms (at streams_sustained), plus details.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import re
import shutil
import statistics
import subprocess
import time
from pathlib import Path

import aiohttp
from _harness import (
    chat_body,
    closed_loop,
    compare_non_streaming,
    flat_decode_profiles,
    pct_ms,
    start_gateway,
    start_worker,
)

TOKENS_PER_S = 50.0
ITL_BUDGET_MS = 5.0


def proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def streams(url: str, n: int, seconds: float) -> tuple[list[float], list[float], int]:
    """n concurrent streams of ~`seconds` each: (inter-token gaps s, per-stream tokens/s, errors)."""
    max_tokens = int(seconds * TOKENS_PER_S)
    gaps: list[float] = []
    rates: list[float] = []
    errors = 0
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=seconds * 4 + 60)) as s:
        async def one(i: int) -> None:
            nonlocal errors
            await asyncio.sleep(i * 0.5 / max(n, 1))  # stagger starts over 0.5 s
            body = chat_body(i, max_tokens, stream=True, ignore_eos=True, stream_options={"include_usage": True})
            async with s.post(url, data=body, headers={"content-type": "application/json"}) as r:
                if r.status != 200:
                    errors += 1
                    return
                first = last = None
                count = 0
                tokens = 0
                async for line in r.content:
                    if line.startswith(b"data: {") and b'"usage":{' in line:
                        tokens = json.loads(line[6:])["usage"]["completion_tokens"]
                    if not line.startswith(b"data: {") or b'"content"' not in line or b'"content":""' in line:
                        continue  # only messages carrying tokens (not the role chunk, not usage)
                    now = time.perf_counter()
                    if last is not None:
                        gaps.append(now - last)
                    else:
                        first = now
                    last = now
                    count += 1
                if first is not None and last is not None and count > 1:
                    # tokens/s from the first to the last content message (usage counts tokens; a
                    # message may carry several when the sim merged steps)
                    rates.append((max(tokens, count) - 1) / (last - first))

        await asyncio.gather(*(one(i) for i in range(n)))
    return gaps, rates, errors


def profile_gateway(pid: int, url: str, args: argparse.Namespace, out_dir: Path) -> list[tuple[str, float]]:
    if shutil.which("py-spy") is None:
        print("py-spy not installed: no profile")
        return []
    out_dir.mkdir(parents=True, exist_ok=True)
    raw = out_dir / "gateway.pyspy.txt"
    spy = subprocess.Popen(["py-spy", "record", "-p", str(pid), "-r", "200", "-f", "raw", "-o", str(raw),
                            "-d", "30", "--nonblocking"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)
    asyncio.run(closed_loop(url, args.requests, args.concurrency))
    spy.send_signal(2)  # SIGINT: py-spy writes what it has
    spy.wait(timeout=30)
    self_time: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()  # our own functions, callees included
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        frames = [re.sub(r":\d+\)$", ")", f) for f in stack.split(";")]  # per function, not per line
        total += int(count)
        self_time[frames[-1]] += int(count)
        for f in set(frames):
            if "deepinfer_gateway/" in f:
                inclusive[f] += int(count)
    top = [(frame, round(100 * c / total, 1)) for frame, c in self_time.most_common(25)]
    ours = [(frame, round(100 * c / total, 1)) for frame, c in inclusive.most_common(15)]
    print("gateway inclusive time of deepinfer_gateway functions (% of samples):")
    for frame, share in ours:
        print(f"  {share:5.1f}%  {frame}")
    (out_dir / "gateway.inclusive.json").write_text(json.dumps(ours, indent=1))
    (out_dir / "gateway.top.json").write_text(json.dumps(top, indent=1))
    print("gateway self time, top functions (% of samples):")
    for frame, share in top:
        print(f"  {share:5.1f}%  {frame}")
    return top


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", default="50,100,150,200,300,400")
    parser.add_argument("--stream-seconds", type=float, default=8.0)
    parser.add_argument("--stream-rounds", type=int, default=3,
                        help="direct/gateway rounds per level (alternating); figures are medians over rounds")
    parser.add_argument("--profile", default=None, help="directory for a py-spy profile of the gateway")
    args = parser.parse_args()
    summary: dict[str, object] = {}

    # --- non-streaming ---
    summary.update(compare_non_streaming(args.requests, args.concurrency, args.rounds))
    if args.profile:
        worker, worker_url = start_worker(1000)
        gateway = start_gateway(worker_url)
        try:
            summary["profile_top"] = profile_gateway(gateway.proc.proc.pid, gateway.url + "/v1/chat/completions",
                                                     args, Path(args.profile))[:10]
        finally:
            gateway.stop()
            worker.stop()

    # --- streaming at 50 tok/s per stream ---
    worker, worker_url = start_worker(1.0, flat_decode_profiles(TOKENS_PER_S))
    gateway = None
    sustained, sustained_itl = 0, None
    levels = []
    try:
        gateway = start_gateway(worker_url, "between_events_timeout_s = 30\n")
        targets = {"direct": worker_url + "/v1/chat/completions", "gateway": gateway.url + "/v1/chat/completions"}
        for n in (int(x) for x in args.streams.split(",")):
            # Rounds alternate direct and gateway so the machine's noise (other processes on the
            # shared cores) hits both sides alike; each figure is the median over rounds. One
            # run per side made a p99 difference of +-5 ms from noise alone decide the level.
            per_round: list[dict[str, float]] = []
            for _ in range(args.stream_rounds):
                one: dict[str, float] = {}
                for name, url in targets.items():
                    cpu0 = (proc_cpu_s(worker.proc.pid), proc_cpu_s(gateway.proc.proc.pid))
                    gaps, rates, errors = asyncio.run(streams(url, n, args.stream_seconds))
                    cpu1 = (proc_cpu_s(worker.proc.pid), proc_cpu_s(gateway.proc.proc.pid))
                    events = max(1, len(gaps) + n)
                    one[f"{name}_worker_cpu_us_per_event"] = 1e6 * (cpu1[0] - cpu0[0]) / events
                    if name == "gateway":
                        one["gateway_cpu_us_per_event"] = 1e6 * (cpu1[1] - cpu0[1]) / events
                    one[f"{name}_itl_p50_ms"] = pct_ms(gaps, 0.5)
                    one[f"{name}_itl_p99_ms"] = pct_ms(gaps, 0.99)
                    one[f"{name}_min_rate"] = min(rates) if rates else 0.0
                    one[f"{name}_median_rate"] = statistics.median(rates) if rates else 0.0
                    one[f"{name}_errors"] = errors
                one["added_itl_p99_ms"] = one["gateway_itl_p99_ms"] - one["direct_itl_p99_ms"]
                per_round.append(one)
            row: dict[str, object] = {"streams": n, "rounds": len(per_round)}
            for key in per_round[0]:
                values = [r[key] for r in per_round]
                if key.endswith("_errors"):
                    row[key] = int(sum(values))
                elif key.endswith("_min_rate"):
                    row[key] = round(min(values), 1)
                else:
                    digits = 0 if key.endswith("_us_per_event") else 1 if key.endswith("_rate") else 2
                    row[key] = round(statistics.median(values), digits) if digits else round(statistics.median(values))
            row["added_itl_p99_ms_rounds"] = [round(r["added_itl_p99_ms"], 2) for r in per_round]
            added = float(row["added_itl_p99_ms"])  # type: ignore[arg-type]  # median of the rounds' differences
            direct_rate = float(row["direct_median_rate"])  # type: ignore[arg-type]
            ok = (added <= ITL_BUDGET_MS and direct_rate >= 0.9 * TOKENS_PER_S
                  and float(row["gateway_median_rate"]) >= 0.95 * direct_rate  # type: ignore[arg-type]
                  and row["gateway_errors"] == 0)
            row["sustained"] = ok
            levels.append(row)
            print(json.dumps(row), flush=True)
            if ok:
                sustained, sustained_itl = n, added
            else:
                break
    finally:
        if gateway:
            gateway.stop()
        worker.stop()
    summary.update(streams_sustained=sustained, stream_added_itl_p99_ms=sustained_itl, stream_levels=levels)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
