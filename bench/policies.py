"""Routing policies compared on a real trace: every policy, memory-only vs tiered KV (docs/policies.md).

    python bench/policies.py [--trace FILE] [--requests 2000] [--speedup 17] [--time-scale 0.25]
                             [--policies round_robin,...] [--configs memory_only,tiered]
                             [--memory-blocks auto] [--out DIR]

For every cluster configuration and every policy, one COLD run: a fresh `sim-cluster`
process (the demo's PD topology: prefill pool 2 sm100 + 1 ascend950, decode pool 2 sm100
+ 1 ascend950) and a fresh gateway (`serve`, `[router] policy = NAME`), then the first
`--requests` requests of the trace replayed open-loop through the HTTP gateway with the
load generator (`deepinfer_gateway.loadgen.run.run_bench`: exact prompt synthesis from the
trace's hash ids, the openai SDK, streaming), then both processes stopped.

Configurations
- `memory_only`: `sim-cluster --no-store`: each worker's own HBM prefix cache only (what
  vLLM/SGLang deployments run today); the PD hand-off is a direct transfer.
- `tiered`: worker memory + the shared KV store (DeepSeek's 3FS design). All six sim
  workers live in ONE `sim-cluster` process and share one in-process `InMemoryKvStore`;
  blocks are salted by KV format, so the sm100 workers share one store namespace and the
  ascend950 workers another (an Ascend worker never hits an sm100 block).

Time
- `--time-scale T` is the sim's: every simulated duration lasts 1/T wall seconds.
- `--speedup S` compresses the trace's arrivals relative to the SIM clock: request i
  arrives at `arrival_i / S` simulated seconds, i.e. `arrival_i / (S * T)` wall seconds
  (the bench replay's own speedup is S * T).
- Every latency below is in SIMULATED seconds (wall seconds x T), so results do not
  depend on T except through the gateway's and client's own overhead, which shrinks by
  T (T < 1 slows the sim so the Python gateway's few milliseconds matter less).

Capacities (the defaults, and why)
- KV: 890 bytes/token (DeepInfer), 128-token blocks = 113,920 bytes/block.
- Per-worker memory tier: `--memory-blocks auto` = 1,404,494 / S blocks (~82,600 at S=17:
  10.6M tokens, 9.4 GB). A real 4-GPU SM100 instance has ~160 GB of HBM for KV =
  1,404,494 blocks, which would hold this whole 2,000-request slice (38,788 unique
  512-token blocks = 155k 128-token blocks) with room to spare. But compressing arrivals
  S-fold also brings every session's next turn back S times sooner at the same per-instance
  load; so, to keep what matters for eviction (tokens written to an instance between two
  turns of a session, relative to its capacity) equal to production at this load, the
  memory shrinks by the same S. Equivalently: it models a production instance whose
  160 GB serve S times as many concurrent sessions as this slice holds. Effect on the
  comparison: policies that keep a session on one worker (prefix_approx, cache_aware,
  estimated_ttft) fit their share of the working set (~52k blocks per prefill worker);
  policies that spray a session over all workers (round_robin, least_load,
  power_of_two) write every session to every worker and evict, so they lose memory hits
  they would keep with 160 GB. `--memory-blocks 0` uses the profile's 160 GB instead.
  The same capacity applies to decode workers (it also bounds their running KV).
- Shared store: the sim's default `InMemoryKvStore` (10M blocks = 1.14 TB, chat TTL 7
  days): holds the whole slice, as DeepSeek's 3FS (~100 PiB, days of TTL) would. Read
  bandwidth 25 GB/s per 4-GPU instance (profiles.toml: 3FS ~400 Gbps per 8 GPUs); a
  10k-token prefix loads in ~0.36 ms against ~31 ms to recompute it on sm100. Bandwidth
  contention between readers is not modelled by the sim.

Figures, per configuration and policy
- `hit_rate_memory`, `hit_rate_store`, `hit_rate`: the gateway's /metrics deltas over
  the replay: dgw_cached_prompt_tokens_total{tier} / dgw_prompt_tokens_total (first legs:
  prefill and PD-bypass; `hit_rate` = memory + store).
- `ttft_p50_s`, `ttft_p99_s`, `itl_p50_s`: client-side (send -> first content chunk;
  gaps between content chunks), nearest-rank, ok requests, simulated seconds.
- `load_max_over_mean`: every `--sample-interval` wall seconds during the replay (first
  send to last response), each prefill worker's GET /v1/worker/load `queued_prefill_tokens`
  is read directly from the worker. With q_w = the mean of worker w's samples,
  load_max_over_mean = max_w q_w / mean_w q_w (1.0 = perfectly even queues; 3.0 = all
  queued prefill on one of the three workers). Queued tokens, not time: an ascend950
  queue of the same size drains 0.6x as fast.
- `requests`: trace requests selected; `sent`: requests the replay sent; `ok`;
  `errors`: requests that ended in an explicit error (HTTP status or stream error);
  `lost` = requests - (ok + errors): requests never sent or never answered either way.
  `duplicates`: request indices recorded more than once. `worker_prompt_tokens_excess`:
  prompt tokens the workers admitted on first legs minus what the gateway counted (> 0
  means some prompt ran twice, e.g. a retry after admission).
- `prefill_utilization`: offered prefill work / pool capacity over the arrival window:
  sum over prefill workers of (prompt - memory-cached - store-cached tokens) from their
  load reports, divided by (trace span / S) x the pool's prefill capacity (each instance's
  dp_ranks x max_num_batched_tokens per full step, at the profile's curve: sm100 324k
  tok/s, ascend950 194k tok/s (an assumption: 0.6 x sm100), pool 842k tok/s);
  per worker likewise against its own capacity. `prefill_busy_fraction`: measured,
  the fraction of samples in which a prefill worker had queued prefill tokens, averaged
  over workers. The JSON's `prefill_utilization_round_robin` is round_robin's offered
  utilization in that configuration.
- `oracle_hit_rate`: the trace slice's infinite global cache hit rate
  (deepinfer_gateway/workload/oracle.py, 512-token blocks, token-weighted).

Default compression: S = 17 puts the prefill pool at ~60-80% offered utilization under
round_robin in both configurations on the conversation trace (measured 0.74 / 0.72 on
800 requests; the ideal simulator gives 0.68 / 0.64 on 2,000). At S = 1 one 4-GPU sm100
prefill instance would be ~13% busy with no cache at all, and the pool ~5%.

Default time scale: T = 0.25 keeps the gateway + sim + client under ~1 core on a 2-core
machine (~55 ms of CPU per request in all); the full default run then takes ~35 minutes
(12 runs x (157 s of arrivals + ~15 s of start-up)). Results and method: docs/policies.md.

Output: a table per configuration on stdout, per-run directories under `--out`
(results.jsonl, summary.json, loads.json, metrics.txt), and ONE JSON object as the last
line of stdout (schema in docs/policies.md).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # harness/, at the repository root
from deepinfer_gateway.config.policies import POLICIES
from deepinfer_gateway.core.protocol import KV_BLOCK_TOKENS
from deepinfer_gateway.loadgen.replay import ReplayConfig
from deepinfer_gateway.loadgen.run import BenchConfig, run_bench
from deepinfer_gateway.workers.sim.profiles import load_profiles
from deepinfer_gateway.workers.sim.step_model import prefill_seconds
from deepinfer_gateway.workload.oracle import oracle_hit_rate
from deepinfer_gateway.workload.traces import load_trace
from deepinfer_gateway.workload.types import read_records
from harness.launch import Gateway, SimCluster

DEFAULT_TRACE = "mooncake:conversation"  # downloaded once into the cache (docs/bench.md)
PD_WORKERS = "prefill:sm100,prefill:sm100,prefill:ascend950,decode:sm100,decode:sm100,decode:ascend950"
CONFIGS = ("memory_only", "tiered")
POLICY_ORDER = ("round_robin", "least_load", "power_of_two", "prefix_approx", "cache_aware", "estimated_ttft")
HBM_KV_BYTES_PER_INSTANCE = 160e9  # 4 SM100 GPUs x ~40 GB of HBM left for KV (profiles.toml)


def hbm_blocks(kv_bytes_per_token: int = 890) -> int:
    return int(HBM_KV_BYTES_PER_INSTANCE // (kv_bytes_per_token * KV_BLOCK_TOKENS))


def memory_blocks_for(arg: str, speedup: float) -> int | None:
    """`auto`: the 160 GB instance scaled by 1/speedup (docstring); `0`: the profile's own; else N."""
    if arg == "auto":
        return max(1024, int(hbm_blocks() / speedup))
    n = int(arg)
    return n or None


# --- pool capacity -------------------------------------------------------------------------

def instance_prefill_tokens_per_s(hardware: str) -> float:
    """A full step on every DP rank (max_num_batched_tokens each), at the profile's curve."""
    p = load_profiles()[hardware]
    return p.dp_ranks * p.max_num_batched_tokens / prefill_seconds(p, p.max_num_batched_tokens)


# --- load sampling -------------------------------------------------------------------------

def _get_json(url: str, timeout: float = 2.0) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        answer: dict[str, Any] = json.load(r)
        return answer


@dataclass
class LoadSampler:
    """Polls the prefill workers' load reports in a thread while the replay runs."""

    urls: dict[str, str]  # worker label -> base url
    interval_s: float
    samples: dict[str, list[int]] = field(default_factory=dict)  # one value per round, every worker
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self.samples = {w: [] for w in self.urls}
        self._thread = threading.Thread(target=self._run, daemon=True, name="load-sampler")
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            row = {}
            for w, url in self.urls.items():
                try:
                    row[w] = int(_get_json(url + "/v1/worker/load")["queued_prefill_tokens"])
                except (OSError, ValueError, KeyError):
                    break
            if len(row) == len(self.urls):
                for w, q in row.items():
                    self.samples[w].append(q)
            self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - started)))

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


def active_window(samples: dict[str, list[int]]) -> dict[str, list[int]]:
    """Drop the leading and trailing rounds in which no prefill worker had queued tokens
    (tokenizer load, warm-up, drain): the replay's window, without hooking into it."""
    rounds = list(zip(*samples.values(), strict=True)) if samples else []
    busy = [i for i, r in enumerate(rounds) if any(r)]
    if not busy:
        return {w: [] for w in samples}
    return {w: s[busy[0]: busy[-1] + 1] for w, s in samples.items()}


def load_stats(samples: dict[str, list[int]]) -> dict[str, Any]:
    samples = active_window(samples)
    means = {w: (sum(s) / len(s) if s else 0.0) for w, s in samples.items()}
    overall = sum(means.values()) / len(means) if means else 0.0
    busy = {w: (sum(1 for x in s if x > 0) / len(s) if s else 0.0) for w, s in samples.items()}
    return {
        "load_max_over_mean": (max(means.values()) / overall) if overall > 0 else 1.0,
        "mean_queued_prefill_tokens": {w: round(m, 1) for w, m in means.items()},
        "max_queued_prefill_tokens": {w: max(s, default=0) for w, s in samples.items()},
        "busy_fraction": {w: round(b, 3) for w, b in busy.items()},
        "prefill_busy_fraction": sum(busy.values()) / len(busy) if busy else 0.0,
        "samples_per_worker": min((len(s) for s in samples.values()), default=0),
    }


# --- metrics -------------------------------------------------------------------------------

def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process and its reaped children (Linux /proc)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def scrape_metrics(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        text: str = r.read().decode("utf-8", "replace")
        return text


def metric_samples(text: str, name: str) -> dict[str, float]:
    """`name{labels} value` lines -> {labels: value} (labels text without braces)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith((name + "{", name + " ")):
            head, _, value = line.rpartition(" ")
            labels = head[len(name):].strip("{}")
            out[labels] = out.get(labels, 0.0) + float(value)
    return out


_TRACES: dict[tuple[str, int], Any] = {}


def _trace(path: str, n: int) -> Any:
    if (path, n) not in _TRACES:
        _TRACES[(path, n)] = load_trace(path).head(n)
    return _TRACES[(path, n)]


# --- one run -------------------------------------------------------------------------------

@dataclass(frozen=True)
class RunSpec:
    trace: str
    requests: int
    speedup: float
    time_scale: float
    memory_blocks: int | None
    sample_interval_s: float
    health_interval_s: float
    out: Path


def _worker_labels(cluster: SimCluster) -> list[tuple[str, str, str, str]]:
    """(label, url, role, hardware) in cluster order; labels like prefill-sm100-0."""
    out: list[tuple[str, str, str, str]] = []
    seen: Counter[tuple[str, str]] = Counter()
    for url, spec in zip(cluster.urls, cluster.specs, strict=True):
        role, hardware = spec.split(":")
        label = f"{role}-{hardware}-{seen[(role, hardware)]}"
        seen[(role, hardware)] += 1
        out.append((label, url, role, hardware))
    return out


def run_one(config: str, policy: str, spec: RunSpec, tmp: Path) -> dict[str, Any]:
    out = spec.out / config / policy
    extra = ["--no-store"] if config == "memory_only" else []
    if spec.memory_blocks:
        extra += ["--memory-blocks", str(spec.memory_blocks)]
    t0 = time.monotonic()
    cluster = SimCluster(PD_WORKERS, time_scale=spec.time_scale, extra=extra)
    gateway: Gateway | None = None
    try:
        workers = _worker_labels(cluster)
        gateway = Gateway(tmp, [(url, role, hw) for _, url, role, hw in workers],
                          extra_toml=f'[router]\npolicy = "{policy}"\n',
                          health_interval_s=spec.health_interval_s)
        gateway.wait_ready(len(workers), timeout=30)
        prefill = {label: url for label, url, role, _ in workers if role == "prefill"}
        sampler = LoadSampler(prefill, spec.sample_interval_s)
        bench = BenchConfig(
            url=gateway.url, trace=spec.trace, out=out, max_requests=spec.requests, plots=False,
            replay=ReplayConfig(mode="open", speedup=spec.speedup * spec.time_scale, progress=False,
                                drain_timeout_s=600.0),
            request_timeout_s=600.0)
        gw_cpu0, sim_cpu0 = _cpu_s(gateway.proc.proc.pid), _cpu_s(cluster.proc.proc.pid)
        started = time.monotonic()
        summary = run_bench(bench, before_run=sampler.start)
        sampler.stop()
        replay_wall = time.monotonic() - started
        metrics = scrape_metrics(gateway.url)
        loads = {label: _get_json(url + "/v1/worker/load") for label, url, _, _ in workers}
        cpu = {"gateway": _cpu_s(gateway.proc.proc.pid) - gw_cpu0,
               "sim_cluster": _cpu_s(cluster.proc.proc.pid) - sim_cpu0}
    finally:
        if gateway is not None:
            gateway.stop()
        cluster.stop()
    (out / "metrics.txt").write_text(metrics)
    (out / "loads.json").write_text(json.dumps({"final": loads, "queued_samples": sampler.samples}) + "\n")
    records = read_records(out / "results.jsonl")
    row = _figures(config, policy, spec, summary, records, loads, sampler.samples, metrics,
                   replay_wall, time.monotonic() - t0, workers)
    client = (summary.get("client_cpu") or {}).get("total_s") or 0.0
    wall = summary["wall_s"] or 1.0
    row["details"]["cores_used"] = {"gateway": round(cpu["gateway"] / wall, 2),
                                    "sim_cluster": round(cpu["sim_cluster"] / wall, 2),
                                    "client": round(client / wall, 2), "machine_cores": os.cpu_count()}
    return row


def _figures(config: str, policy: str, spec: RunSpec, summary: dict[str, Any], records: list[Any],
             loads: dict[str, dict[str, Any]], samples: dict[str, list[int]], metrics: str,
             replay_wall: float, run_wall: float, workers: list[tuple[str, str, str, str]]) -> dict[str, Any]:
    T = spec.time_scale
    cache = summary["cache_hit_rate"]
    mem, store = cache["memory"], cache["store"]
    ok = sum(1 for r in records if r.ok)
    errors = sum(1 for r in records if not r.ok)
    indices = Counter(r.index for r in records)
    selected = summary["trace_requests_selected"]

    def sim(x: float | None) -> float | None:
        return None if x is None else round(x * T, 5)

    # Offered prefill work and capacity (sim seconds).
    trace = _trace(spec.trace, spec.requests)
    span_sim = (trace.requests[-1].arrival_s - trace.requests[0].arrival_s) / spec.speedup if trace.requests else 0
    offered, capacity, per_worker = 0.0, 0.0, {}
    for label, _, role, hw in workers:
        if role != "prefill":
            continue
        rep = loads[label]
        cached = sum(rep.get("cached_tokens_total", {}).values())
        uncached = rep.get("prompt_tokens_total", 0) - cached
        cap = instance_prefill_tokens_per_s(hw)
        offered += uncached
        capacity += cap
        per_worker[label] = round(uncached / (cap * span_sim), 3) if span_sim else None
    worker_prompt = sum(rep.get("prompt_tokens_total", 0) for rep in loads.values())
    gw_prompt = sum(metric_samples(metrics, "dgw_prompt_tokens_total").values())
    decisions = {k: int(v) for k, v in metric_samples(metrics, "dgw_routing_decisions_total").items()}
    statuses = {k: int(v) for k, v in metric_samples(metrics, "dgw_requests_total").items()}
    retries = {k: int(v) for k, v in metric_samples(metrics, "dgw_retries_total").items()}
    loadstat = load_stats(samples)
    return {
        "hit_rate": round(mem + store, 4) if mem is not None and store is not None else None,
        "hit_rate_memory": None if mem is None else round(mem, 4),
        "hit_rate_store": None if store is None else round(store, 4),
        "ttft_p50_s": sim(summary["ttft_s"]["p50"]),
        "ttft_p99_s": sim(summary["ttft_s"]["p99"]),
        "itl_p50_s": sim(summary["itl_s"]["p50"]),
        "load_max_over_mean": round(loadstat["load_max_over_mean"], 3),
        "requests": selected,
        "errors": errors,
        "lost": selected - (ok + errors),
        "details": {
            "sent": len(records), "ok": ok, "error_kinds": summary["errors"],
            "duplicates": sum(n - 1 for n in indices.values() if n > 1),
            "worker_prompt_tokens_excess": int(worker_prompt - gw_prompt),
            "hit_rate_client_reported": cache["total"],
            "ttft_mean_s": sim(summary["ttft_s"]["mean"]), "ttft_p90_s": sim(summary["ttft_s"]["p90"]),
            "e2e_p50_s": sim(summary["e2e_s"]["p50"]),
            "prefill_utilization": round(offered / (capacity * span_sim), 3) if span_sim else None,
            "prefill_utilization_per_worker": per_worker,
            "prefill_busy_fraction": round(loadstat["prefill_busy_fraction"], 3),
            "busy_fraction_per_worker": loadstat["busy_fraction"],
            "mean_queued_prefill_tokens": loadstat["mean_queued_prefill_tokens"],
            "max_queued_prefill_tokens": loadstat["max_queued_prefill_tokens"],
            "load_samples_per_worker": loadstat["samples_per_worker"],
            "requests_per_worker": summary["workers"],
            "routing_decisions": decisions,
            "gateway_requests": statuses,
            "retries": retries,
            "send_lag_p99_wall_s": summary["send_lag_s"]["p99"],
            "replay_wall_s": round(replay_wall, 1),
            "run_wall_s": round(run_wall, 1),
        },
    }


# --- report --------------------------------------------------------------------------------

COLUMNS = (("hit", "hit_rate"), ("mem", "hit_rate_memory"), ("store", "hit_rate_store"),
           ("ttft50", "ttft_p50_s"), ("ttft99", "ttft_p99_s"), ("itl50", "itl_p50_s"),
           ("ld_max/mean", "load_max_over_mean"), ("req", "requests"), ("err", "errors"), ("lost", "lost"))


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 100 else f"{v:.0f}"
    return str(v)


def print_table(config: str, result: dict[str, Any]) -> None:
    print(f"\n== {config} == (prefill utilization under round_robin: "
          f"{_fmt(result.get('prefill_utilization_round_robin'))})", flush=True)
    header = f"{'policy':<15}" + "".join(f"{name:>12}" for name, _ in COLUMNS) + f"{'util':>8}{'busy':>8}{'wall':>7}"
    print(header)
    for name, row in result["policies"].items():
        d = row["details"]
        print(f"{name:<15}" + "".join(f"{_fmt(row[key]):>12}" for _, key in COLUMNS)
              + f"{_fmt(d['prefill_utilization']):>8}{_fmt(d['prefill_busy_fraction']):>8}"
              f"{_fmt(d['run_wall_s']):>7}", flush=True)


def targets(result: dict[str, Any], oracle: float | None) -> dict[str, Any]:
    """The targets for estimated_ttft (docs/policies.md), checked (None when a run is missing)."""
    out: dict[str, Any] = {}
    for config, res in result.items():
        pol = res["policies"]
        et, rr = pol.get("estimated_ttft"), pol.get("round_robin")
        if et is None:
            continue
        checks: dict[str, Any] = {
            "load_max_over_mean<=1.3": et["load_max_over_mean"] <= 1.3,
            "no_lost_or_duplicated": all(p["lost"] == 0 and p["details"]["duplicates"] == 0 for p in pol.values()),
        }
        if rr is not None and et["ttft_p99_s"] is not None and rr["ttft_p99_s"]:
            ratio = et["ttft_p99_s"] / rr["ttft_p99_s"]
            limit = 0.5 if config == "memory_only" else 0.8
            checks[f"ttft_p99_ratio<={limit}"] = {"ratio": round(ratio, 3), "met": ratio <= limit}
        if config == "memory_only" and oracle and et["hit_rate"] is not None:
            checks["hit_rate>=0.9xoracle"] = {"ratio": round(et["hit_rate"] / oracle, 3),
                                               "met": et["hit_rate"] >= 0.9 * oracle}
        out[config] = checks
    return out


def _interrupt(signum: int, frame: object) -> None:
    """SIGTERM stops like Ctrl-C, so the `finally` blocks stop the cluster and the gateway."""
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default=DEFAULT_TRACE)
    ap.add_argument("--requests", type=int, default=2000, help="first N requests of the trace")
    ap.add_argument("--speedup", type=float, default=17.0,
                    help="arrival compression relative to the SIM clock (trace seconds per simulated second)")
    ap.add_argument("--time-scale", type=float, default=0.25,
                    help="sim time scale: simulated durations last 1/T wall seconds (wall replay speedup = S x T)")
    ap.add_argument("--policies", default=",".join(POLICY_ORDER))
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--memory-blocks", default="auto",
                    help="per-worker memory tier (128-token blocks): auto = 160 GB instance / speedup; 0 = profile's")
    ap.add_argument("--sample-interval", type=float, default=0.1, help="wall seconds between load samples")
    ap.add_argument("--health-interval", type=float, default=0.2,
                    help="gateway load-report poll interval, wall seconds")
    ap.add_argument("--out", default=None, help="run directories (default: a temporary directory)")
    args = ap.parse_args(argv)

    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [p for p in policies if p not in POLICIES] + [c for c in configs if c not in CONFIGS]
    if unknown:
        raise SystemExit(f"unknown policy/config: {unknown}")
    trace = _trace(args.trace, args.requests)
    oracle = oracle_hit_rate(trace.requests, trace.block_size)
    mem_blocks = memory_blocks_for(args.memory_blocks, args.speedup)
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="dgw-policies-"))
    spec = RunSpec(args.trace, args.requests, args.speedup, args.time_scale, mem_blocks, args.sample_interval,
                   args.health_interval, out)
    span = trace.requests[-1].arrival_s if trace.requests else 0.0
    print(f"trace {trace.name}: {len(trace.requests)} requests over {span:.0f} s, oracle hit rate "
          f"{_fmt(oracle)}; speedup {args.speedup:g} (sim), time scale {args.time_scale:g} -> "
          f"~{span / (args.speedup * args.time_scale):.0f} s of wall arrivals per run; per-worker memory "
          f"{mem_blocks or 'profile default'} blocks; runs under {out}", flush=True)

    result: dict[str, Any] = {}
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="dgw-policies-cfg-") as tmp:
        for config in configs:
            res: dict[str, Any] = {"policies": {}}
            for policy in policies:
                row = run_one(config, policy, spec, Path(tmp))
                res["policies"][policy] = row
                print(f"[{config}/{policy}] hit {_fmt(row['hit_rate'])} ttft p50/p99 {_fmt(row['ttft_p50_s'])}/"
                      f"{_fmt(row['ttft_p99_s'])} s load {_fmt(row['load_max_over_mean'])} util "
                      f"{_fmt(row['details']['prefill_utilization'])} errors {row['errors']} lost {row['lost']} "
                      f"({row['details']['run_wall_s']} s)", file=sys.stderr, flush=True)
            rr = res["policies"].get("round_robin")
            res["prefill_utilization_round_robin"] = rr["details"]["prefill_utilization"] if rr else None
            result[config] = res
    for config, res in result.items():
        print_table(config, res)
    checks = targets(result, oracle)
    print(f"\ntargets (estimated_ttft): {json.dumps(checks)}")
    print(f"total wall {time.monotonic() - started:.0f} s; details in {out}", flush=True)
    final = {
        "oracle_hit_rate": None if oracle is None else round(oracle, 4),
        "settings": {"trace": trace.name, "requests": args.requests, "speedup": args.speedup,
                     "time_scale": args.time_scale, "memory_blocks_per_worker": mem_blocks,
                     "latency_unit": "simulated seconds"},
        "configs": {c: {"policies": {p: {k: v for k, v in row.items() if k != "details"}
                                     for p, row in res["policies"].items()},
                        "prefill_utilization_round_robin": res["prefill_utilization_round_robin"]}
                    for c, res in result.items()},
        "targets": checks,
    }
    (out / "policies.json").write_text(json.dumps({**final, "details": {
        c: {p: row["details"] for p, row in res["policies"].items()} for c, res in result.items()}}, indent=2) + "\n")
    print(json.dumps(final))
    return 0


if __name__ == "__main__":
    sys.exit(main())
