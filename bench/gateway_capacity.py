"""Gateway capacity on this machine: what the gateway adds in front of sim workers.

    python bench/gateway_capacity.py [--requests 2000] [--concurrency 16] [--rounds 3]
        [--streams 50,100,150,200,300,400] [--stream-seconds 8] [--stream-rounds 3]
        [--chunk-streams 100] [--chunk-seconds 6] [--processes 1,2] [--baseline DIR] [--profile DIR]

Non-streaming: short chat requests to a sim worker that answers instantly (time scale
1000), directly (its OpenAI-compatible endpoint) and through the gateway, rounds
alternating; req/s and the added p50/p99 latency (medians over rounds).
`cpu_ms_per_request`: the gateway's CPU (its process tree's threads' run time, /proc
schedstat, see `proc_cpu_s`) over a round, per request; median over rounds.

Per output token: `--chunk-streams` concurrent streams of `--chunk-seconds` at 50 tokens/s
each, from two sim workers: `step1` decodes one token per step (one worker message and one
relayed SSE chunk per token), `dspark` runs DeepInfer's DSpark sweep (3 draft tokens at 75%
acceptance: 3.25 tokens per step on average, one message and one chunk per step) at the
same 50 tokens/s. The gateway's CPU over a round, minus its per-request cost
(`cpu_ms_per_request` x streams) and its idle rate (`chunk_idle_cpu_ms_per_s`, measured
before) x the round's wall time, per output token the clients were sent (their
usage) is `cpu_us_per_output_token_step1` / `_dspark` (`cpu_us_per_output_token`: the
dspark one), and per content chunk `cpu_us_per_chunk` (step1); each the median over
`--rounds`, every round running each gateway (and the baseline's) on both workers in turn,
with the rounds' values listed. `--nextn N` runs one worker with N draft tokens per step
instead (mode `nextnN`; `cpu_us_per_chunk` and `cpu_us_per_output_token` are then its).

Idle: `idle_cpu_ms_per_s`, the gateway's own fixed cost: one gateway process in front of
`--idle-workers` (4) sim workers with no traffic, its process tree's CPU over
`--idle-seconds` (10) as ms per second, median of `--idle-rounds` (3; 0 skips it), with
`baseline_idle_cpu_ms_per_s` interleaved when `--baseline` is given (bench/idle_cpu.py's
setup, which also reports how far the prefix index lags the workers).

Processes: `rps_1`, `rps_2`... req/s of the non-streaming load through a gateway started
with `processes=N` (`serve --processes N`), each level in the same interleaved rounds; null
when this checkout's launch.Gateway takes no `processes`. `cpu_ms_per_request_N`: CPU per
request of the whole supervisor tree at N (its processes and the embedded Redis they share).
With `--baseline`, the baseline tree runs every level too (`baseline_rps_N`...). The client,
the worker and the gateway processes share the machine's cores, so on a 2-core box the
ratio is bounded by the client and the worker, not by the gateway.

Baseline: `--baseline DIR` runs a second gateway from another source tree (e.g. `git
archive <commit> | tar -x -C DIR`; imported with PYTHONSAFEPATH=1 PYTHONPATH=DIR) in every
phase, rounds interleaved with this tree's; its figures carry the prefix `baseline_`.
`--baseline-toml TOML` gives the baseline gateway settings of its own; without `--baseline`
the baseline is the tree under test with them, and `--toml` gives the gateway under test its
own: `--toml 'worker_protocol = "auto"' --baseline-toml 'worker_protocol = "v1"'` measures
worker protocol v2 (one connection per worker) against v1 (one HTTP stream per request) in
the same run.
`--tree DIR` takes the gateway under test from a source tree too (a snapshot, so edits to
the checkout during the run do not reach it).

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

`--profile DIR`: py-spy (if installed: on PATH or beside this Python) samples the gateway
during one extra non-streaming round and one extra chunk round; the top functions are
printed and saved (`gateway.top.json`, `gateway.inclusive.json`, `stream.*.json`).

The last line is one JSON object: direct_rps, gateway_rps, added_p50_ms, added_p99_ms,
cpu_ms_per_request, cpu_us_per_output_token_step1, cpu_us_per_output_token_dspark,
cpu_us_per_chunk, idle_cpu_ms_per_s, rps_1, rps_2, streams_sustained,
stream_added_itl_p99_ms (at streams_sustained), plus details (and `baseline_*`).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import inspect
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # harness/, at the repository root
from _granian import GranianGateway
from _harness import (
    chat_body,
    closed_loop,
    flat_decode_profiles,
    pct_ms,
    start_worker,
)
from idle_cpu import SETTLE_S as IDLE_SETTLE_S
from idle_cpu import Setup as IdleSetup

from harness.launch import Gateway

TOKENS_PER_S = 50.0
ITL_BUDGET_MS = 5.0
WARMUP_REQUESTS = 200


def proc_cpu_s(pid: int) -> float:
    """CPU seconds of a process's live threads so far: the scheduler's nanosecond run time
    (/proc/<pid>/task/*/schedstat). utime + stime (/proc/<pid>/stat) count 10 ms clock ticks,
    which quantised the idle rate to 5 ms/s over a 2 s window (~2.5 us per chunk of the net
    figure) and a short round's CPU to ~2%; they are the fallback where schedstat is absent."""
    try:
        return sum(int((task / "schedstat").read_text().split()[0])
                   for task in Path(f"/proc/{pid}/task").iterdir()) / 1e9
    except (FileNotFoundError, IndexError, ValueError):
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tree_cpu_s(pid: int) -> float:
    """CPU seconds of a process and its live descendants (a multi-process gateway's workers)."""
    total = 0.0
    pending = [pid]
    while pending:
        current = pending.pop()
        try:
            total += proc_cpu_s(current)
            for task in Path(f"/proc/{current}/task").iterdir():
                pending += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue  # exited meanwhile
    return total


class Target:
    """A gateway under test (its own source tree, process count) or the worker itself."""

    def __init__(self, name: str, url: str, gateway: Gateway | None = None):
        self.name = name
        self.url = url
        self.gateway = gateway

    def cpu_s(self) -> float:
        return tree_cpu_s(self.gateway.proc.proc.pid) if self.gateway else 0.0

    def stop(self) -> None:
        if self.gateway:
            self.gateway.stop()


def start_gateway(worker_url: str, tree: str | None = None, processes: int = 1, extra_toml: str = "",
                  server: str = "uvicorn") -> Gateway:
    """A gateway in front of one worker; `tree`: import the package from that source tree;
    `server`: granian serves the same app instead of `serve`'s uvicorn (bench/_granian.py)."""
    env = {"PYTHONSAFEPATH": "1", "PYTHONPATH": tree} if tree else None
    gateway: Gateway
    if server == "granian":
        gateway = GranianGateway(worker_url, extra_toml, env)  # type: ignore[assignment]
    else:
        kwargs: dict[str, object] = {"processes": processes} if processes != 1 else {}
        gateway = Gateway(Path(tempfile.mkdtemp()), [(worker_url, "unified", "sm100")], extra_toml=extra_toml,
                          env=env, **kwargs)  # type: ignore[arg-type]
    gateway.wait_ready(1)
    return gateway


def has_baseline(args: argparse.Namespace) -> bool:
    return bool(args.baseline or args.baseline_toml or args.server != "uvicorn")


def gateways(worker_url: str, args: argparse.Namespace, extra_toml: str = "") -> list[Target]:
    """The gateway under test, and the baseline one when asked for (another tree, or this one with
    `--baseline-toml`: e.g. worker protocol v1 against v2; or uvicorn where `--server` is another)."""
    targets = [Target("gateway", "", start_gateway(worker_url, args.tree, extra_toml=extra_toml + args.toml,
                                                   server=args.server))]
    if has_baseline(args):
        targets.append(Target("baseline", "", start_gateway(worker_url, args.baseline or args.tree,
                                                            extra_toml=extra_toml + args.baseline_toml)))
    for t in targets:
        assert t.gateway is not None
        t.url = t.gateway.url + "/v1/chat/completions"
    return targets


def supports_processes() -> bool:
    return "processes" in inspect.signature(Gateway.__init__).parameters


def idle_cpu_ms_per_s(target: Target, seconds: float = 2.0) -> float:
    cpu0 = target.cpu_s()
    time.sleep(seconds)
    return 1000 * (target.cpu_s() - cpu0) / seconds


def non_streaming(args: argparse.Namespace, levels: list[int]) -> dict[str, object]:
    """Direct vs gateway (vs baseline, vs N processes): latency, req/s, gateway CPU per request;
    rounds interleave every target so the shared machine's noise hits all alike."""
    worker, worker_url = start_worker(1000)
    targets = [Target("direct", worker_url + "/v1/chat/completions")]
    try:
        targets += gateways(worker_url, args)
        for n in levels:
            if n != 1:
                gw = start_gateway(worker_url, args.tree, processes=n)
                targets.append(Target(f"processes_{n}", gw.url + "/v1/chat/completions", gw))
                if has_baseline(args):
                    gw = start_gateway(worker_url, args.baseline or args.tree, processes=n,
                                       extra_toml=args.baseline_toml)
                    targets.append(Target(f"baseline_processes_{n}", gw.url + "/v1/chat/completions", gw))
        for t in targets:
            asyncio.run(closed_loop(t.url, WARMUP_REQUESTS, args.concurrency))
        rows: dict[str, list[dict[str, float]]] = {t.name: [] for t in targets}
        for round_no in range(args.rounds):
            for t in targets:
                cpu0 = t.cpu_s()
                lat, rps, errors = asyncio.run(closed_loop(t.url, args.requests, args.concurrency))
                cpu = t.cpu_s() - cpu0
                if errors:
                    raise SystemExit(f"{t.name}: {errors} failed requests")
                row = {"p50_ms": pct_ms(lat, 0.5), "p99_ms": pct_ms(lat, 0.99), "rps": rps,
                       "cpu_ms_per_request": 1000 * cpu / args.requests}
                rows[t.name].append(row)
                print(f"round {round_no} {t.name:12s} p50 {row['p50_ms']:7.2f} ms  p99 {row['p99_ms']:7.2f} ms"
                      f"  {rps:7.1f} req/s  gateway cpu {row['cpu_ms_per_request']:.3f} ms/req", flush=True)
    finally:
        for t in targets:
            t.stop()
        worker.stop()

    def med(name: str, key: str) -> float:
        return round(statistics.median(r[key] for r in rows[name]), 3)

    out: dict[str, object] = {f"direct_{k}": med("direct", k) for k in ("p50_ms", "p99_ms", "rps")}
    for t in targets[1:]:
        if "processes_" in t.name:
            continue
        prefix = "" if t.name == "gateway" else "baseline_"
        for k in ("p50_ms", "p99_ms", "rps"):
            out[f"{prefix}gateway_{k}"] = med(t.name, k)
        out[f"{prefix}added_p50_ms"] = round(med(t.name, "p50_ms") - med("direct", "p50_ms"), 2)
        out[f"{prefix}added_p99_ms"] = round(med(t.name, "p99_ms") - med("direct", "p99_ms"), 2)
        out[f"{prefix}cpu_ms_per_request"] = med(t.name, "cpu_ms_per_request")
        out[f"{prefix}cpu_ms_per_request_rounds"] = [round(r["cpu_ms_per_request"], 3) for r in rows[t.name]]
    for prefix, single in (("", "gateway"), ("baseline_", "baseline")):
        for n in levels:
            name = single if n == 1 else f"{prefix}processes_{n}"
            if name in rows:
                out[f"{prefix}rps_{n}"] = med(name, "rps")
                if n != 1:  # the supervisor's tree: its processes and the embedded Redis
                    out[f"{prefix}cpu_ms_per_request_{n}"] = med(name, "cpu_ms_per_request")
            elif not prefix:
                out[f"rps_{n}"] = None
    return out


async def streams(url: str, n: int, seconds: float) -> tuple[list[float], list[float], int, int, int]:
    """n concurrent streams of ~`seconds` each: (inter-token gaps s, per-stream tokens/s, errors,
    content chunks received, output tokens received: the usage chunks' sum)."""
    max_tokens = int(seconds * TOKENS_PER_S)
    gaps: list[float] = []
    rates: list[float] = []
    errors = 0
    chunks = 0
    output_tokens = 0
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=seconds * 4 + 60)) as s:
        async def one(i: int) -> None:
            nonlocal errors, chunks, output_tokens
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
                chunks += count
                output_tokens += tokens
                if first is not None and last is not None and count > 1:
                    # tokens/s from the first to the last content message (usage counts tokens; a
                    # message may carry several when the sim merged steps)
                    rates.append((max(tokens, count) - 1) / (last - first))

        await asyncio.gather(*(one(i) for i in range(n)))
    return gaps, rates, errors, chunks, output_tokens


def step_modes(nextn: int | None) -> dict[str, int]:
    """The per-token phase's sim workers by name: draft tokens per decode step (module doc)."""
    return {"step1": 0, "dspark": 3} if nextn is None else {f"nextn{nextn}": nextn}


def chunk_cost(args: argparse.Namespace, per_request_ms: dict[str, float]) -> dict[str, object]:
    """Gateway CPU per output token (and per chunk), net of per-request and idle cost, at one
    token per step and at DSpark's steps (see the module doc)."""
    modes = step_modes(args.nextn)
    workers = {mode: start_worker(1.0, flat_decode_profiles(TOKENS_PER_S, nextn)) for mode, nextn in modes.items()}
    targets: dict[str, list[Target]] = {}
    out: dict[str, object] = {}
    try:
        for mode, (_, worker_url) in workers.items():
            targets[mode] = gateways(worker_url, args, "between_events_timeout_s = 30\n")
        idle = {(mode, t.name): idle_cpu_ms_per_s(t) for mode, ts in targets.items() for t in ts}
        per_token: dict[tuple[str, str], list[float]] = {key: [] for key in idle}
        per_chunk: dict[tuple[str, str], list[float]] = {key: [] for key in idle}
        steps: dict[tuple[str, str], list[float]] = {key: [] for key in idle}
        for round_no in range(args.rounds):
            for mode, ts in targets.items():
                for t in ts:
                    cpu0, wall0 = t.cpu_s(), time.perf_counter()
                    _, _, errors, chunks, tokens = asyncio.run(streams(t.url, args.chunk_streams, args.chunk_seconds))
                    cpu, wall = t.cpu_s() - cpu0, time.perf_counter() - wall0
                    if errors or not chunks or not tokens:
                        raise SystemExit(f"{mode} {t.name}: {errors} failed streams, {chunks} chunks")
                    net = cpu - args.chunk_streams * per_request_ms[t.name] / 1000 - idle[mode, t.name] / 1000 * wall
                    per_token[mode, t.name].append(1e6 * net / tokens)
                    per_chunk[mode, t.name].append(1e6 * net / chunks)
                    steps[mode, t.name].append(tokens / chunks)
                    print(f"round {round_no} {mode:6s} {t.name:8s} {tokens} tokens in {chunks} chunks"
                          f"  gateway cpu {cpu:.2f} s  net {1e6 * net / tokens:.1f} us/token"
                          f"  {1e6 * net / chunks:.1f} us/chunk", flush=True)
        first, last = next(iter(modes)), list(modes)[-1]
        for (mode, name), values in per_token.items():
            prefix = "" if name == "gateway" else "baseline_"
            out[f"{prefix}cpu_us_per_output_token_{mode}"] = round(statistics.median(values), 1)
            out[f"{prefix}cpu_us_per_output_token_{mode}_rounds"] = [round(x, 1) for x in values]
            out[f"{prefix}tokens_per_chunk_{mode}"] = round(statistics.median(steps[mode, name]), 2)
            if mode == last:
                out[f"{prefix}cpu_us_per_output_token"] = out[f"{prefix}cpu_us_per_output_token_{mode}"]
            if mode == first:
                out[f"{prefix}cpu_us_per_chunk"] = round(statistics.median(per_chunk[mode, name]), 1)
                out[f"{prefix}cpu_us_per_chunk_rounds"] = [round(x, 1) for x in per_chunk[mode, name]]
                out[f"{prefix}chunk_idle_cpu_ms_per_s"] = round(idle[mode, name], 1)
        if args.profile:
            profiled = targets[last][0]
            profile_gateway(profiled, lambda: asyncio.run(streams(profiled.url, args.chunk_streams,
                                                                  args.chunk_seconds)), Path(args.profile), "stream")
    finally:
        for ts in targets.values():
            for t in ts:
                t.stop()
        for worker, _ in workers.values():
            worker.stop()
    return out


def stream_levels(args: argparse.Namespace) -> dict[str, object]:
    """Concurrent 50 tok/s streams: the largest level each gateway sustains (see the module doc)."""
    worker, worker_url = start_worker(1.0, flat_decode_profiles(TOKENS_PER_S))
    targets: list[Target] = [Target("direct", worker_url + "/v1/chat/completions")]
    summary: dict[str, object] = {}
    try:
        gws = gateways(worker_url, args, "between_events_timeout_s = 30\n")
        targets += gws
        for gw in gws:
            prefix = "" if gw.name == "gateway" else "baseline_"
            summary.update(one_gateway_levels(args, worker, targets[0], gw, prefix))
    finally:
        for t in targets:
            t.stop()
        worker.stop()
    return summary


def one_gateway_levels(args: argparse.Namespace, worker: object, direct: Target, gateway: Target,
                       prefix: str) -> dict[str, object]:
    sustained, sustained_itl = 0, None
    levels = []
    worker_pid = worker.proc.pid  # type: ignore[attr-defined]
    for n in (int(x) for x in args.streams.split(",")):
        # Rounds alternate direct and gateway so the machine's noise (other processes on the
        # shared cores) hits both sides alike; each figure is the median over rounds. One
        # run per side made a p99 difference of +-5 ms from noise alone decide the level.
        per_round: list[dict[str, float]] = []
        for _ in range(args.stream_rounds):
            one: dict[str, float] = {}
            for name, target in (("direct", direct), ("gateway", gateway)):
                cpu0 = (proc_cpu_s(worker_pid), gateway.cpu_s())
                gaps, rates, errors, _, _ = asyncio.run(streams(target.url, n, args.stream_seconds))
                cpu1 = (proc_cpu_s(worker_pid), gateway.cpu_s())
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
        row: dict[str, object] = {"target": gateway.name, "streams": n, "rounds": len(per_round)}
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
        if not ok:
            break
        sustained, sustained_itl = n, added
    return {f"{prefix}streams_sustained": sustained, f"{prefix}stream_added_itl_p99_ms": sustained_itl,
            f"{prefix}stream_levels": levels}


def py_spy() -> str | None:
    return shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))


def profile_gateway(target: Target, load: object, out_dir: Path, label: str) -> list[tuple[str, float]]:
    """py-spy samples the gateway while `load()` runs: top self and inclusive time, printed and saved."""
    spy_bin = py_spy()
    if spy_bin is None or target.gateway is None:
        print("py-spy not installed: no profile")
        return []
    out_dir.mkdir(parents=True, exist_ok=True)
    raw = out_dir / f"{label}.pyspy.txt"
    spy = subprocess.Popen([spy_bin, "record", "-p", str(target.gateway.proc.proc.pid), "-r", "500", "-f", "raw",
                            "-o", str(raw), "-d", "60", "--nonblocking"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)
    load()  # type: ignore[operator]
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
    print(f"{label}: gateway inclusive time of deepinfer_gateway functions (% of {total} samples):")
    for frame, share in ours:
        print(f"  {share:5.1f}%  {frame}")
    (out_dir / f"{label}.inclusive.json").write_text(json.dumps(ours, indent=1))
    (out_dir / f"{label}.top.json").write_text(json.dumps(top, indent=1))
    print(f"{label}: gateway self time, top functions (% of samples):")
    for frame, share in top:
        print(f"  {share:5.1f}%  {frame}")
    return top


def idle_fleet(args: argparse.Namespace) -> dict[str, object]:
    """`idle_cpu_ms_per_s`: the gateway's CPU with `--idle-workers` sim workers and no traffic,
    over `--idle-seconds` (scheduler run time: `tree_cpu_s`), median of `--idle-rounds`
    (bench/idle_cpu.py's setup: one gateway process, default health interval, KV events from
    every worker), the baseline's interleaved with it."""
    trees = [("gateway", args.tree or str(Path(__file__).resolve().parent.parent))]
    if args.baseline:
        trees.append(("baseline", args.baseline))
    values: dict[str, list[float]] = {name: [] for name, _ in trees}
    for round_no in range(args.idle_rounds):
        for name, tree in trees if round_no % 2 == 0 else trees[::-1]:
            setup = IdleSetup(tree, args.idle_workers, 1)
            try:
                time.sleep(IDLE_SETTLE_S)
                assert setup.gateway is not None
                pid = setup.gateway.proc.proc.pid
                cpu0, t0 = tree_cpu_s(pid), time.monotonic()
                time.sleep(args.idle_seconds)
                values[name].append(1000 * (tree_cpu_s(pid) - cpu0) / (time.monotonic() - t0))
            finally:
                setup.stop()
    out: dict[str, object] = {"idle_workers": args.idle_workers}
    for name, rates in values.items():
        prefix = "" if name == "gateway" else "baseline_"
        out[f"{prefix}idle_cpu_ms_per_s"] = round(statistics.median(rates), 2)
        out[f"{prefix}idle_cpu_ms_per_s_rounds"] = [round(x, 2) for x in rates]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", default="50,100,150,200,300,400", help="stream levels ('' skips them)")
    parser.add_argument("--stream-seconds", type=float, default=8.0)
    parser.add_argument("--stream-rounds", type=int, default=3,
                        help="direct/gateway rounds per level (alternating); figures are medians over rounds")
    parser.add_argument("--chunk-streams", type=int, default=100)
    parser.add_argument("--chunk-seconds", type=float, default=6.0)
    parser.add_argument("--nextn", type=int, default=None,
                        help="one per-token phase sim with N speculative tokens per step (default: two, "
                             "step1 with 0 and dspark with 3)")
    parser.add_argument("--processes", default="1,2", help="gateway process counts for rps_N")
    parser.add_argument("--baseline", default=None, help="source tree of a baseline gateway run side by side")
    parser.add_argument("--toml", default="", help="gateway settings (TOML) for the gateway under test only, "
                                                   "e.g. 'worker_protocol = \"auto\"' (v2)")
    parser.add_argument("--baseline-toml", default="",
                        help="gateway settings (TOML) for the baseline only; without --baseline the baseline is "
                             "this tree with them, e.g. 'worker_protocol = \"v1\"' against v2")
    parser.add_argument("--tree", default=None, help="source tree of the gateway under test (default: this checkout)")
    parser.add_argument("--server", choices=("uvicorn", "granian"), default="uvicorn",
                        help="granian: the gateway under test served by granian (bench/_granian.py), one process, "
                             "the baseline by uvicorn")
    parser.add_argument("--profile", default=None, help="directory for py-spy profiles of the gateway")
    parser.add_argument("--idle-workers", type=int, default=4)
    parser.add_argument("--idle-seconds", type=float, default=10.0)
    parser.add_argument("--idle-rounds", type=int, default=3, help="0 skips idle_cpu_ms_per_s")
    args = parser.parse_args()
    levels = [int(x) for x in args.processes.split(",") if x]
    if args.server != "uvicorn":
        levels = [n for n in levels if n == 1]  # bench/_granian.py serves one process
    if not supports_processes():
        print("launch.Gateway takes no `processes`: rps_N for N > 1 not measured", flush=True)
        levels = [n for n in levels if n == 1]
    summary: dict[str, object] = idle_fleet(args) if args.idle_rounds else {}
    summary.update(non_streaming(args, levels))
    for n in args.processes.split(","):
        summary.setdefault(f"rps_{n}", None)
    if args.profile:
        worker, worker_url = start_worker(1000)
        target = Target("gateway", "", start_gateway(worker_url, args.tree))
        target.url = target.gateway.url + "/v1/chat/completions"  # type: ignore[union-attr]
        try:
            # a fresh process's first requests pay one-time set-up (tokenizer tables, connections)
            asyncio.run(closed_loop(target.url, min(args.requests, 300), args.concurrency))
            summary["profile_top"] = profile_gateway(
                target, lambda: asyncio.run(closed_loop(target.url, args.requests, args.concurrency)),
                Path(args.profile), "gateway")[:10]
        finally:
            target.stop()
            worker.stop()
    per_request = {"gateway": float(summary["cpu_ms_per_request"])}  # type: ignore[arg-type]
    if has_baseline(args):
        per_request["baseline"] = float(summary["baseline_cpu_ms_per_request"])  # type: ignore[arg-type]
    summary.update(chunk_cost(args, per_request))
    if args.streams:
        summary.update(stream_levels(args))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
