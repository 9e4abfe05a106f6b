"""What large-prompt preparation costs every other stream: relay latency under preparation.

    python bench/relay_under_prep.py [--modes pool,thread,loop,thread@0.5] [--rounds 2]
        [--phase-s 6] [--streams 8] [--burst 4] [--burst-every 1.5] [--big-tokens 100000]

One sim worker decoding at exactly 50 tokens/s per stream (flat decode profile, time scale 1)
behind one gateway per mode. `--streams` clients each send short streaming chat requests
(`--small-tokens` output tokens) back to back; we record each one's TTFT and every
inter-token gap at the client. Each mode gets a quiet phase (small streams only) and a
loaded phase: the same plus, every `--burst-every` s, a burst of `--burst` concurrent
~`--big-tokens`-token prompts (a distinct text each, so the gateway's segment cache misses
and every one is tokenized cold). The big prompts ask for `max_tokens` = the context
limit, so the gateway refuses them with a 400 *after* preparing them in full (parse,
template, tokenize, max_tokens resolution): their whole cost lands on the gateway, none on
the worker, and any change in the small streams' latency is the gateway's.

Modes (`DGW_PREPARE_OFFLOAD`, recipe_bridge/offload.py): `thread` (the default) = one
dedicated preparation thread with a 0.5 ms GIL switch interval, `pool` = asyncio's default
executor (up to min(32, cpus + 4) preparations at once; Python's 5 ms switch interval),
`loop` = prepared inline on the event loop. `MODE@MS` sets the gateway's switch interval
to MS ms (`thread@5`: one thread, Python's default interval).
Rounds go through the modes in turn, so machine noise hits all of them.

Reported per mode (medians over rounds): small-stream TTFT p50/p90 and ITL p50/p99/max
in the quiet and loaded phases, the added (loaded - quiet) figures, big-prompt latency
(send -> 400) p50, and big prompts prepared per second. The last line is one JSON object;
`ratio_vs_<first mode>` compares each mode's added TTFT p90 / ITL p99 with the first's.

Result (`--modes pool,thread@5,thread,loop --rounds 2`, other flags at their defaults:
bursts of 4 prompts of ~80k tokens every 1.5 s; a 2-core machine at load average ~1.1;
added = loaded - quiet, medians over rounds, ms):

    mode      added TTFT p50  p90   added ITL p99  loaded ITL max  big prompt p50
    pool                -0.1  11.6            6.6              70             212
    thread@5             0.4   4.0            6.9              41             241
    thread               0.1   2.4            2.4              39             239
    loop                 0.1  20.5           12.5              79             228

Inline preparation stops the loop for a whole preparation (~60 ms for 80k tokens); one
thread keeps the gaps smallest, and the 0.5 ms interval matters most on a busy machine.
The price of one thread: a burst's prompts are prepared one after another (239 vs 212 ms
for the median big prompt of a burst of 4). What still holds the GIL in one piece: the
library's template rendering and `special_ranges` (~2-4 ms per 400 kB) and packing (~1 ms).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import orjson

sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # harness/, at the repository root
from _harness import MODEL, chat_body, flat_decode_profiles, pct_ms, start_worker

from deepinfer_gateway.recipe_bridge.prepare import OFFLOAD_ENV, parse_offload
from harness.launch import Gateway

TOKENS_PER_S = 50.0
CONTEXT_LIMIT = 131_072


def big_text(tokens: int) -> str:
    sys.path.insert(0, str(Path(__file__).parent))
    import random

    from preprocess import _text  # mixed prose, code, numbers, CJK: ~4 characters per token

    return _text(random.Random(11), tokens)


async def small_stream_client(session: aiohttp.ClientSession, url: str, i: int, small_tokens: int, stop_at: float,
                              ttfts: list[float], gaps: list[float], errors: list[str]) -> None:
    await asyncio.sleep(i * 0.05)
    n = 0
    while time.perf_counter() < stop_at:
        body = chat_body(i * 1000 + n, small_tokens, stream=True, ignore_eos=True)
        n += 1
        sent = time.perf_counter()
        last = None
        async with session.post(url, data=body, headers={"content-type": "application/json"}) as r:
            if r.status != 200:
                errors.append(f"small {r.status}")
                await r.read()
                continue
            async for line in r.content:
                if not line.startswith(b"data: {") or b'"content"' not in line or b'"content":""' in line:
                    continue
                now = time.perf_counter()
                if last is None:
                    ttfts.append(now - sent)
                else:
                    gaps.append(now - last)
                last = now


async def big_bursts(session: aiohttp.ClientSession, url: str, text: str, burst: int, every: float, stop_at: float,
                     latencies: list[float], errors: list[str]) -> None:
    async def one() -> None:
        content = f"[{uuid.uuid4().hex}] " + text  # distinct: the segment cache misses
        body = orjson.dumps({"model": MODEL, "max_tokens": CONTEXT_LIMIT, "stream": True,
                             "thinking": {"type": "disabled"}, "messages": [{"role": "user", "content": content}]})
        sent = time.perf_counter()
        async with session.post(url, data=body, headers={"content-type": "application/json"}) as r:
            await r.read()
            if r.status != 400:
                errors.append(f"big {r.status}")
        latencies.append(time.perf_counter() - sent)

    next_at = time.perf_counter()
    tasks = []
    while next_at < stop_at - 0.5:
        await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
        tasks += [asyncio.create_task(one()) for _ in range(burst)]
        next_at += every
    await asyncio.gather(*tasks)


async def phase(url: str, args: argparse.Namespace, text: str | None) -> dict[str, object]:
    ttfts: list[float] = []
    gaps: list[float] = []
    big: list[float] = []
    errors: list[str] = []
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as session:
        started = time.perf_counter()
        stop_at = started + args.phase_s
        jobs = [small_stream_client(session, url, i, args.small_tokens, stop_at, ttfts, gaps, errors)
                for i in range(args.streams)]
        if text is not None:
            jobs.append(big_bursts(session, url, text, args.burst, args.burst_every, stop_at, big, errors))
        await asyncio.gather(*jobs)
        wall = time.perf_counter() - started
    out: dict[str, object] = {
        "ttft_p50_ms": pct_ms(ttfts, 0.5), "ttft_p90_ms": pct_ms(ttfts, 0.9),
        "itl_p50_ms": pct_ms(gaps, 0.5), "itl_p99_ms": pct_ms(gaps, 0.99), "itl_max_ms": max(gaps) * 1000,
        "itl_mean_ms": statistics.fmean(gaps) * 1000, "small_requests": len(ttfts), "errors": len(errors),
    }
    if text is not None:
        out["big_latency_p50_ms"] = pct_ms(big, 0.5)
        out["big_per_s"] = len(big) / wall
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", default="pool,thread@5,thread,loop")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--phase-s", type=float, default=6.0)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--small-tokens", type=int, default=20)
    parser.add_argument("--burst", type=int, default=4)
    parser.add_argument("--burst-every", type=float, default=1.5)
    parser.add_argument("--big-tokens", type=int, default=100_000)
    args = parser.parse_args()

    text = big_text(args.big_tokens)
    modes = args.modes.split(",")
    worker, worker_url = start_worker(1.0, flat_decode_profiles(TOKENS_PER_S))
    results: dict[str, list[dict[str, object]]] = {m: [] for m in modes}
    tmp = Path(tempfile.mkdtemp())
    try:
        for round_no in range(args.rounds):
            for spec in modes:
                parse_offload(spec)  # fail early on a typo
                gateway = Gateway(tmp, [(worker_url, "unified", "sm100")], extra_toml="between_events_timeout_s = 30",
                                  env={OFFLOAD_ENV: spec})
                try:
                    gateway.wait_ready(1)
                    url = gateway.url + "/v1/chat/completions"
                    asyncio.run(phase(url, argparse.Namespace(**{**vars(args), "phase_s": 1.0}), None))  # warm-up
                    quiet = asyncio.run(phase(url, args, None))
                    loaded = asyncio.run(phase(url, args, text))
                finally:
                    gateway.stop()
                row = {**{f"quiet_{k}": v for k, v in quiet.items()}, **{f"loaded_{k}": v for k, v in loaded.items()}}
                results[spec].append(row)
                print(f"round {round_no} {spec:12s} quiet ttft p50/p90 {quiet['ttft_p50_ms']:6.1f}/"
                      f"{quiet['ttft_p90_ms']:6.1f}"
                      f" itl p99 {quiet['itl_p99_ms']:6.1f} | loaded ttft p50/p90 {loaded['ttft_p50_ms']:6.1f}/"
                      f"{loaded['ttft_p90_ms']:6.1f} itl p50/p99/max {loaded['itl_p50_ms']:5.1f}/"
                      f"{loaded['itl_p99_ms']:6.1f}/"
                      f"{loaded['itl_max_ms']:6.1f} big p50 {loaded['big_latency_p50_ms']:6.1f} ms"
                      f" {loaded['big_per_s']:.2f}/s errors {quiet['errors']}+{loaded['errors']}", flush=True)
    finally:
        worker.stop()

    summary: dict[str, Any] = {"params": {k: v for k, v in vars(args).items() if k != "modes"}}
    first = modes[0]
    for spec, rows in results.items():
        med = {k: round(statistics.median(float(r[k]) for r in rows), 2) for k in rows[0]}  # type: ignore[arg-type]
        for key in ("ttft_p50_ms", "ttft_p90_ms", "itl_p99_ms", "itl_mean_ms"):
            med[f"added_{key}"] = round(med[f"loaded_{key}"] - med[f"quiet_{key}"], 2)
        summary[spec] = med
    base = summary[first]
    for spec in modes[1:]:
        row = summary[spec]
        row[f"ratio_vs_{first}"] = {
            key: round(row[key] / base[key], 2) if base[key] > 0 else None
            for key in ("added_ttft_p50_ms", "added_ttft_p90_ms", "added_itl_p99_ms", "added_itl_mean_ms")}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
