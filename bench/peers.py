"""Head-to-head: this gateway and the peer routers in front of the same cold sim cluster.

    python bench/peers.py [--requests 200] [--targets gateway,sglang-router,vllm-router]
                          [--trace mooncake:conversation] [--speedup 17] [--time-scale 0.25]
                          [--workers unified:sm100,unified:sm100,unified:sm100,unified:ascend950]
                          [--memory-blocks auto] [--out DIR]

Targets
- `gateway`: `deepinfer-gateway serve` (its default policy, estimated_ttft), talking to the
  workers through the worker protocol.
- `sglang-router`: sglang-router 0.3.2, `python -m sglang_router.launch_router --policy
  cache_aware`, talking to the workers' OpenAI/SGLang-compatible endpoints.
- `vllm-router`: vllm-router 0.1.17, `vllm-router --policy cache_aware` (it renders each
  chat request on the workers' `/v1/chat/completions/render` before routing).
The peer routers are installed from PyPI once into cached venvs (bench/peer_venvs.py). Every
router runs with warning-level logs (per-request info lines would cost them CPU) and its
other settings at their defaults.

Run
For each target, a COLD cluster: a fresh `sim-cluster` process (`--workers`, memory tier only:
`--no-store`, each worker's prefix cache sized as bench/policies.py's `auto`), a fresh
router, one warm-up request (a prompt shorter than one KV block, so nothing it leaves is
reusable), then the first `--requests` requests of the trace replayed open-loop with the
project's load generator (`deepinfer_gateway.loadgen.run.run_bench`: the openai SDK,
streaming, exact prompt synthesis from the trace's hash ids, `ignore_eos` so every target
generates the trace's output lengths), then both processes stopped.

Figures per target
- `ttft_p50_s`, `ttft_p90_s`, `ttft_p99_s`: client-side time to first content chunk, ok
  requests, in SIMULATED seconds (wall x `--time-scale`, as bench/policies.py).
- `hit_rate`: sum of cached / sum of prompt tokens over the replay, as the workers count them
  (their load reports, read after the warm-up and at the end); `hit_rate_client`: the same
  from the usage each response reported.
- `errors`: requests that ended in an error; `lost`: selected requests neither ok nor errored.
- `router_cpu_ms_per_req`: user + system CPU of the router's process tree (/proc/<pid>/stat,
  reaped children included) over the replay, per selected request; `workers_cpu_ms_per_req`:
  the same for the sim-cluster process. Both include what the process spends while idle
  (health checks, KV event polls, background threads): `router_idle_cpu_ms_per_s` is the
  router's CPU per second over 5 s of idling after the warm-up, for scale at small `--requests`.
The last line of stdout is one JSON object `{"rows": [...], ...}`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sibling bench scripts

from peer_venvs import PEER_ROUTERS, ensure_venv  # noqa: E402
from policies import memory_blocks_for  # noqa: E402

from deepinfer_gateway.launch import Gateway, SimCluster, free_port, wait_for_port  # noqa: E402
from deepinfer_gateway.loadgen.replay import ReplayConfig  # noqa: E402
from deepinfer_gateway.loadgen.run import BenchConfig, run_bench  # noqa: E402
from deepinfer_gateway.protocol import DEFAULT_MODEL  # noqa: E402
from deepinfer_gateway.workload.oracle import oracle_hit_rate  # noqa: E402
from deepinfer_gateway.workload.traces import load_trace  # noqa: E402
from deepinfer_gateway.workload.types import read_records  # noqa: E402

DEFAULT_TRACE = "mooncake:conversation"
DEFAULT_WORKERS = "unified:sm100,unified:sm100,unified:sm100,unified:ascend950"
TARGETS = ("gateway", "sglang-router", "vllm-router")
GATEWAY_HEALTH_INTERVAL_S = 1.0  # the gateway's default ([health] interval_s), not launch.Gateway's test value
IDLE_PROBE_S = 5.0


# --- CPU of a process tree -------------------------------------------------------------------

def _stat(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def tree_cpu_s(root: int) -> float:
    """utime + stime (+ cutime + cstime: reaped children) of `root` and its live descendants."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := _stat(int(entry))) is not None:
            children.setdefault(int(fields[1]), []).append(int(entry))
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        fields = _stat(pid)
        if fields is not None:
            total += sum(int(x) for x in fields[11:15])
            todo += children.get(pid, [])
    return total / os.sysconf("SC_CLK_TCK")


# --- routers ---------------------------------------------------------------------------------

@dataclass
class Router:
    url: str
    pid: int
    stop: Any  # () -> None


def _peer_command(target: str, venv: Path, port: int, workers: list[str]) -> list[str]:
    common = ["--host", "127.0.0.1", "--port", str(port), "--policy", "cache_aware", "--worker-urls", *workers]
    if target == "sglang-router":
        return [str(venv / "bin" / "python"), "-m", "sglang_router.launch_router", *common, "--log-level", "warn"]
    return [str(venv / "bin" / "vllm-router"), *common, "--log-level", "warning"]


def start_router(target: str, cluster: SimCluster, tmp: Path) -> Router:
    if target == "gateway":
        workers = [(url, *spec.split(":")) for url, spec in zip(cluster.urls, cluster.specs, strict=True)]
        gateway = Gateway(tmp, workers, health_interval_s=GATEWAY_HEALTH_INTERVAL_S)
        gateway.wait_ready(len(cluster.urls), timeout=60)
        return Router(gateway.url, gateway.proc.proc.pid, gateway.stop)
    venv = ensure_venv(PEER_ROUTERS[target])
    port = free_port()
    log = (tmp / f"{target}.log").open("wb")
    proc = subprocess.Popen(_peer_command(target, venv, port, cluster.urls), stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)

    def stop() -> None:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()

    try:
        wait_for_port(port, timeout=120)
    except TimeoutError:
        stop()
        raise
    return Router(f"http://127.0.0.1:{port}", proc.pid, stop)


def warm_up(url: str, timeout_s: float = 60.0) -> None:
    """One tiny chat request, retried until the router answers 200 (peers register workers
    asynchronously after opening their port)."""
    body = json.dumps({"model": DEFAULT_MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    deadline = time.monotonic() + timeout_s
    while True:
        request = urllib.request.Request(url + "/v1/chat/completions", data=body.encode(),
                                         headers={"content-type": "application/json", "authorization": "Bearer x"})
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} never answered a chat request")
        time.sleep(0.5)


def worker_tokens(urls: list[str]) -> tuple[int, int]:
    """(prompt tokens, cached tokens) the workers admitted so far, over all workers."""
    prompt = cached = 0
    for url in urls:
        with urllib.request.urlopen(url + "/v1/worker/load", timeout=5) as response:
            load = json.load(response)
        prompt += int(load.get("prompt_tokens_total", 0))
        cached += int(sum(load.get("cached_tokens_total", {}).values()))
    return prompt, cached


# --- one target ------------------------------------------------------------------------------

@dataclass(frozen=True)
class RunSpec:
    trace: str
    requests: int
    speedup: float
    time_scale: float
    workers: str
    memory_blocks: int | None
    out: Path


def run_target(target: str, spec: RunSpec, tmp: Path) -> dict[str, Any]:
    extra = ["--no-store"] + (["--memory-blocks", str(spec.memory_blocks)] if spec.memory_blocks else [])
    cluster = SimCluster(spec.workers, time_scale=spec.time_scale, extra=extra)
    router: Router | None = None
    try:
        router = start_router(target, cluster, tmp)
        warm_up(router.url)
        idle0 = tree_cpu_s(router.pid)
        time.sleep(IDLE_PROBE_S)
        router_idle = tree_cpu_s(router.pid) - idle0
        bench = BenchConfig(
            url=router.url, trace=spec.trace, out=spec.out / target, max_requests=spec.requests, plots=False,
            ignore_eos=True, request_timeout_s=600.0,
            replay=ReplayConfig(mode="open", speedup=spec.speedup * spec.time_scale, progress=False,
                                drain_timeout_s=600.0))
        tokens0 = worker_tokens(cluster.urls)
        router_cpu0, workers_cpu0 = tree_cpu_s(router.pid), tree_cpu_s(cluster.proc.proc.pid)
        summary = run_bench(bench)
        router_cpu = tree_cpu_s(router.pid) - router_cpu0
        workers_cpu = tree_cpu_s(cluster.proc.proc.pid) - workers_cpu0
        tokens1 = worker_tokens(cluster.urls)
    finally:
        if router is not None:
            router.stop()
        cluster.stop()
    records = read_records(spec.out / target / "results.jsonl")
    ok = [r for r in records if r.ok]
    selected = summary["trace_requests_selected"]
    prompt, cached = tokens1[0] - tokens0[0], tokens1[1] - tokens0[1]
    client_prompt = sum(r.prompt_tokens or 0 for r in ok)
    T = spec.time_scale

    def sim_s(x: float | None) -> float | None:
        return None if x is None else round(x * T, 4)

    ttft = summary["ttft_s"]
    return {
        "target": target,
        "ttft_p50_s": sim_s(ttft["p50"]),
        "ttft_p90_s": sim_s(ttft["p90"]),
        "ttft_p99_s": sim_s(ttft["p99"]),
        "hit_rate": round(cached / prompt, 4) if prompt else None,
        "hit_rate_client": round(sum(r.cached_tokens or 0 for r in ok) / client_prompt, 4) if client_prompt else None,
        "errors": sum(1 for r in records if not r.ok),
        "lost": selected - len(records),
        "router_cpu_ms_per_req": round(1000 * router_cpu / selected, 2),
        "workers_cpu_ms_per_req": round(1000 * workers_cpu / selected, 2),
        "router_idle_cpu_ms_per_s": round(1000 * router_idle / IDLE_PROBE_S, 2),
        "requests": selected,
        "error_kinds": summary["errors"],
        "worker_prompt_tokens": prompt,
        "client_prompt_tokens": client_prompt,
        "wall_s": summary["wall_s"],
    }


# --- report ----------------------------------------------------------------------------------

COLUMNS = (("ttft p50", "ttft_p50_s"), ("p90", "ttft_p90_s"), ("p99", "ttft_p99_s"), ("hit", "hit_rate"),
           ("hit(client)", "hit_rate_client"), ("errors", "errors"), ("router ms/req", "router_cpu_ms_per_req"),
           ("workers ms/req", "workers_cpu_ms_per_req"))


def print_table(rows: list[dict[str, Any]]) -> None:
    print(f"{'target':15s}" + "".join(f"{title:>16s}" for title, _ in COLUMNS))
    for row in rows:
        print(f"{row['target']:15s}" + "".join(f"{'-' if row[k] is None else row[k]!s:>16s}" for _, k in COLUMNS))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=200, help="first N requests of the trace (default 200)")
    parser.add_argument("--targets", default=",".join(TARGETS),
                        help=f"comma-separated, of {list(TARGETS)} (default all)")
    parser.add_argument("--trace", default=DEFAULT_TRACE, help=f"trace spec or file (default {DEFAULT_TRACE})")
    parser.add_argument("--speedup", type=float, default=17.0, help="arrival compression vs the sim clock (default 17)")
    parser.add_argument("--time-scale", type=float, default=0.25, help="sim time scale (default 0.25)")
    parser.add_argument("--workers", default=DEFAULT_WORKERS, help=f"sim-cluster spec (default {DEFAULT_WORKERS})")
    parser.add_argument("--memory-blocks", default="auto",
                        help="per-worker prefix cache blocks: auto (policies.py's), 0 (the profile's) "
                             "or N (default auto)")
    parser.add_argument("--out", default=None, help="directory for per-target records (default: a temporary one)")
    args = parser.parse_args()
    targets = [t for t in args.targets.split(",") if t]
    unknown = set(targets) - set(TARGETS)
    if unknown:
        parser.error(f"unknown targets {sorted(unknown)}; choose from {list(TARGETS)}")
    for target in targets:
        if target in PEER_ROUTERS:
            ensure_venv(PEER_ROUTERS[target])  # installs before any cluster starts
    out = Path(args.out or tempfile.mkdtemp(prefix="dgw-peers-"))
    spec = RunSpec(args.trace, args.requests, args.speedup, args.time_scale, args.workers,
                   memory_blocks_for(args.memory_blocks, args.speedup), out)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for target in targets:
            print(f"--- {target}: cold cluster, {args.requests} requests", file=sys.stderr, flush=True)
            rows.append(run_target(target, spec, Path(tmp)))
    print_table(rows)
    trace = load_trace(args.trace).head(args.requests)
    oracle = oracle_hit_rate(trace.requests, trace.block_size)
    print(json.dumps({"rows": rows, "oracle_hit_rate": None if oracle is None else round(oracle, 4),
                      "requests": args.requests,
                      "workers": args.workers, "speedup": args.speedup, "time_scale": args.time_scale,
                      "memory_blocks": spec.memory_blocks, "trace": args.trace, "out": str(out)}))


if __name__ == "__main__":
    main()
