"""Idle CPU of a gateway in front of sim workers, and how far its prefix index lags them.

    python bench/idle_cpu.py [--tree NAME=DIR ...] [--workers 4] [--window 20] [--rounds 3]
        [--lag-samples 20] [--processes 1]

Per tree (default: this checkout; e.g. `--tree base=/tmp/h-base --tree new=.` to compare
a baseline worktree with this one, each imported with PYTHONSAFEPATH=1 PYTHONPATH=DIR so
its workers and its gateway both run that tree's code), every round starts a `sim-cluster`
of `--workers` unified workers and one gateway (`serve --processes N`, health checks at the
default interval) in front of them, waits until all are healthy and settled, then:

- idle: CPU time (scheduler run time) of the gateway's process tree (/proc) over `--window` seconds with
  no traffic, as ms of CPU per second; the sim-cluster process's too (the worker side of
  the KV event polls).
- lag: `--lag-samples` generate requests sent straight to the workers (round robin, a
  fresh 1,024-token prompt each, one output token); from the end of each reply to the
  moment the gateway's `/admin/index` shows that worker's cursor at the worker's last
  event. The index is read every ~1 ms, so figures carry ~1 ms of sampling error.

Trees alternate within each round and start order flips every round, so the shared
machine's noise hits each alike. The last line is one JSON object: per tree the medians
over rounds (`<name>_gateway_cpu_ms_per_s`, `<name>_workers_cpu_ms_per_s`,
`<name>_lag_p50_ms`, `<name>_lag_p90_ms`) and, with two trees, the ratios last/first.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # harness/, at the repository root
from deepinfer_gateway.core.protocol import GENERATE_PATH, KV_EVENTS_PATH
from harness.launch import CLI, Gateway, Proc, free_port, wait_for_port

SETTLE_S = 3.0  # after the gateway is ready: first polls, health checks and imports settle


def run_time_s(pid: int, stat: list[str]) -> float:
    """A process's CPU seconds: its threads' scheduler run time (ns, /proc/<pid>/task/*/schedstat);
    utime + stime (10 ms clock ticks, which quantise an idle rate to 1 ms/s over 10 s) where
    schedstat is absent."""
    try:
        return sum(int((task / "schedstat").read_text().split()[0])
                   for task in Path(f"/proc/{pid}/task").iterdir()) / 1e9
    except (OSError, IndexError, ValueError):
        return (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")


def tree_cpu_s(root: int) -> float:
    """CPU seconds of `root` and its live descendants (`run_time_s`)."""
    parents: dict[int, list[int]] = {}
    stats: dict[int, list[str]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        stats[int(entry)] = fields
        parents.setdefault(int(fields[1]), []).append(int(entry))
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        if pid in stats:
            total += run_time_s(pid, stats[pid])
            todo += parents.get(pid, [])
    return total


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Setup:
    """A sim-cluster and a gateway in front of it, both from one source tree."""

    def __init__(self, tree: str, workers: int, processes: int) -> None:
        env = {"PYTHONSAFEPATH": "1", "PYTHONPATH": str(Path(tree).resolve())}
        base = free_port()
        while any(_taken(base + i) for i in range(workers)):
            base = free_port()
        self.urls = [f"http://127.0.0.1:{base + i}" for i in range(workers)]
        self.cluster = Proc(CLI + ["sim-cluster", "--workers", ",".join(["unified:sm100"] * workers),
                                   "--base-port", str(base), "--time-scale", "1000"], env=env)
        self.gateway: Gateway | None = None
        try:
            for i in range(workers):
                wait_for_port(base + i, timeout=30)
            self.gateway = Gateway(Path(tempfile.mkdtemp()), [(u, "unified", "sm100") for u in self.urls],
                                   extra_toml="admin_keys_required = false", env=env, health_interval_s=1.0,
                                   processes=processes)
            self.gateway.wait_ready(workers, timeout=30)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        if self.gateway is not None:
            self.gateway.stop()
        self.cluster.stop()


def _taken(port: int) -> bool:
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def idle_cpu(setup: Setup, window_s: float) -> tuple[float, float]:
    assert setup.gateway is not None
    gw_pid, cl_pid = setup.gateway.proc.proc.pid, setup.cluster.proc.pid
    gw0, cl0, t0 = tree_cpu_s(gw_pid), tree_cpu_s(cl_pid), time.monotonic()
    time.sleep(window_s)
    gw1, cl1, t1 = tree_cpu_s(gw_pid), tree_cpu_s(cl_pid), time.monotonic()
    return (gw1 - gw0) * 1000 / (t1 - t0), (cl1 - cl0) * 1000 / (t1 - t0)


async def index_lag(setup: Setup, samples: int, seed: int) -> list[float]:
    """Seconds from the end of a worker's reply to the gateway's index holding its last event."""
    assert setup.gateway is not None
    rng = random.Random(seed)
    lags: list[float] = []
    async with aiohttp.ClientSession() as http:
        for i in range(samples):
            url = setup.urls[i % len(setup.urls)]
            body = {"request_id": f"lag-{seed}-{i}", "token_ids": [rng.randrange(1000, 30000) for _ in range(1024)],
                    "sampling": {"max_tokens": 1}}
            async with http.post(url + GENERATE_PATH, json=body) as resp:
                await resp.read()
            done = time.perf_counter()
            async with http.get(url + KV_EVENTS_PATH, params={"after": 10**12, "limit": 1}) as resp:
                last_seq = (await resp.json())["last_seq"]
            while True:
                async with http.get(setup.gateway.url + "/admin/index") as resp:
                    stats = await resp.json()  # workers keyed by id: host:port of the URL
                if stats["workers"].get(url.split("://", 1)[1], {}).get("last_seq", 0) >= last_seq:
                    lags.append(time.perf_counter() - done)
                    break
                if time.perf_counter() - done > 10:
                    raise SystemExit(f"index never caught up with {url}")
                await asyncio.sleep(0.001)
            await asyncio.sleep(0.05 + rng.random() * 0.05)  # desynchronise from any poll period
    return lags


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", action="append", default=[], help="NAME=DIR, a source tree to run (repeatable)")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--window", type=float, default=20.0, help="seconds of idle CPU measurement per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--lag-samples", type=int, default=20)
    parser.add_argument("--processes", type=int, default=1, help="serve --processes N")
    args = parser.parse_args()
    trees = [tuple(t.split("=", 1)) for t in args.tree] or [("tree", ".")]
    results: dict[str, dict[str, list[float]]] = {name: {"gw": [], "cl": [], "p50": [], "p90": []} for name, _ in trees}
    for round_no in range(args.rounds):
        order = trees if round_no % 2 == 0 else trees[::-1]
        for name, tree in order:
            setup = Setup(tree, args.workers, args.processes)
            try:
                time.sleep(SETTLE_S)
                gw, cl = idle_cpu(setup, args.window)
                lags = asyncio.run(index_lag(setup, args.lag_samples, seed=round_no))
            finally:
                setup.stop()
            p50, p90 = pct(lags, 0.5) * 1000, pct(lags, 0.9) * 1000
            for key, value in (("gw", gw), ("cl", cl), ("p50", p50), ("p90", p90)):
                results[name][key].append(value)
            print(f"round {round_no} {name:6s} gateway {gw:6.2f} ms/s  workers {cl:6.2f} ms/s  "
                  f"index lag p50 {p50:6.2f} ms  p90 {p90:6.2f} ms", flush=True)
    out: dict[str, object] = {"workers": args.workers, "window_s": args.window, "rounds": args.rounds,
                              "processes": args.processes}
    for name, r in results.items():
        out[f"{name}_gateway_cpu_ms_per_s"] = round(statistics.median(r["gw"]), 2)
        out[f"{name}_workers_cpu_ms_per_s"] = round(statistics.median(r["cl"]), 2)
        out[f"{name}_lag_p50_ms"] = round(statistics.median(r["p50"]), 2)
        out[f"{name}_lag_p90_ms"] = round(statistics.median(r["p90"]), 2)
    if len(trees) == 2:
        (first, _), (last, _) = trees
        for key in ("gateway_cpu_ms_per_s", "workers_cpu_ms_per_s", "lag_p50_ms"):
            base = out[f"{first}_{key}"]
            assert isinstance(base, float)
            out[f"ratio_{key}"] = round(float(out[f"{last}_{key}"]) / base, 3) if base else None  # type: ignore[arg-type]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
