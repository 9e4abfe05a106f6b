"""One simulation run: trace -> `RequestRecord`s -> the bench's `summary.json`.

`run_simulation` is the Python API (the router-policy benchmark sweeps with it):

    config = load_cluster("bench/clusters/demo-pd.toml")
    config = config.model_copy(update={"router": config.router.with_policies("cache_aware")})
    records, summary = run_simulation(config, "mooncake:conversation", speedup=2.0, max_requests=1000)

The summary is `workload.summary.summarize` over the simulated records (same schema as
`bench`, docs/bench.md), with per-tier hit rates from the simulated workers' reports and
a `simulation` object (events, steps, events/s, virtual seconds, routing modes).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from deepinfer_gateway.simulate.config import ClusterConfig
from deepinfer_gateway.simulate.sessions import TURN_TOKENS, SessionDriver
from deepinfer_gateway.simulate.simulator import Simulator
from deepinfer_gateway.workers.sim.profiles import load_profiles
from deepinfer_gateway.workload.oracle import oracle_hit_rate
from deepinfer_gateway.workload.sessions import SessionTrace, is_session_spec, load_sessions
from deepinfer_gateway.workload.summary import CostModel, Slo, session_figures, summarize
from deepinfer_gateway.workload.traces import load_trace
from deepinfer_gateway.workload.types import RequestRecord, Trace, write_records


def cluster_gpus(config: ClusterConfig) -> int:
    profiles = load_profiles(config.profiles or None)
    return sum(profiles[g.hardware].gpus_per_instance * g.count for g in config.workers)


def run_simulation(
    config: ClusterConfig,
    trace: Trace | str,
    *,
    speedup: float = 1.0,
    max_requests: int | None = None,
    slo: Slo | None = None,
    gpu_hour_usd: float | None = None,
    hit_window_s: float | None = None,
    header_offset: bool = True,
    out: Path | None = None,
    concurrency: int | None = None,
) -> tuple[list[RequestRecord], dict[str, Any]]:
    """Simulate `trace` (a `Trace`, a file path or a `synthetic:` spec) on `config`.

    speedup: arrivals at `arrival_s / speedup` (as `bench --speedup`); the engines' speed is
    the cluster's `time_scale`. header_offset: lay out token ids as the live bench's chat
    template does (28-token header); False puts trace block 0 at position 0. With `out`,
    writes `results.jsonl` and `summary.json` there. A closed-loop session workload (a session
    file or `synthetic:agent:loop=closed,...`, `workload.sessions`) runs its rounds as their
    dependencies finish in virtual time (simulate/sessions.py): `concurrency` N live sessions,
    else the sessions' arrival times; the summary adds bench's session figures.
    """
    if isinstance(trace, str) and is_session_spec(trace):
        return _run_sessions(config, load_sessions(trace).head(max_requests), speedup=speedup,
                             concurrency=concurrency, slo=slo, gpu_hour_usd=gpu_hour_usd,
                             hit_window_s=hit_window_s, header_offset=header_offset, out=out)
    if concurrency is not None:
        raise ValueError("--concurrency applies to session workloads (a session file or "
                         "synthetic:agent:loop=closed,...); a request trace follows its timestamps")
    if isinstance(trace, str):
        trace = load_trace(trace)
    trace = trace.head(max_requests)
    sim = Simulator(config, speedup=speedup, block_size=trace.block_size, header_offset=header_offset)
    records = sim.run(trace.requests)
    stats = sim.stats
    wall = max((r.arrival_s + r.e2e_s for r in records if r.e2e_s is not None), default=0.0)
    meta = {
        "target": f"simulate:{config.name}", "protocol": "simulated", "model": config.model, "trace": trace.name,
        "trace_requests_selected": len(trace.requests), "mode": "open", "speedup": speedup, "concurrency": None,
        "prompt_synthesis": ("synthetic token ids per trace block id" + (
            ", after a 28-token header as the chat template adds" if header_offset else ", no header")),
        "simulation": _simulation_meta(config, sim),
    }
    summary = summarize(records, wall_s=wall, oracle_hit_rate=oracle_hit_rate(trace.requests, trace.block_size),
                        slo=slo, cost=CostModel(cluster_gpus(config), gpu_hour_usd), tiers=stats.tiers(),
                        hit_window_s=hit_window_s, meta=meta)
    _write(out, records, summary)
    return records, summary


def _simulation_meta(config: ClusterConfig, sim: Simulator) -> dict[str, Any]:
    stats = sim.stats
    return {
        "workers": len(sim.workers), "time_scale": config.time_scale, "policy": config.router.policy.name,
        "events": stats.events, "steps": stats.steps, "heap_events": stats.heap_events,
        "wall_s": round(stats.wall_s, 3),
        "events_per_s": round(stats.events_per_s), "virtual_s": stats.sim_s, "modes": stats.modes,
        "load_report_interval_s": config.load_report_interval_s,
        "kv_events_interval_s": config.kv_events_interval_s,
        # prompt tokens prefilled again after their worker evicted them (workers/sim/prefix_cache.py)
        "evicted_recomputed_tokens": sum(w.core.evicted_recomputed_tokens_total for w in sim.workers),
        **({"session_capacity": {"waits": stats.session_waits, "wait_s": round(stats.session_wait_s, 3),
                                 "proceeded": stats.session_proceeded}} if config.session_capacity.enabled else {}),
    }


def _write(out: Path | None, records: list[RequestRecord], summary: dict[str, Any]) -> None:
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        write_records(out / "results.jsonl", records)
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")


def _run_sessions(config: ClusterConfig, trace: SessionTrace, *, speedup: float, concurrency: int | None,
                  slo: Slo | None, gpu_hour_usd: float | None, hit_window_s: float | None, header_offset: bool,
                  out: Path | None) -> tuple[list[RequestRecord], dict[str, Any]]:
    sim = Simulator(config, speedup=speedup, header_offset=header_offset)
    driver = SessionDriver(sim, trace, concurrency)
    records = driver.run()
    wall = max((r.arrival_s + r.e2e_s for r in records if r.e2e_s is not None), default=0.0)
    meta = {
        "target": f"simulate:{config.name}", "protocol": "simulated", "model": config.model, "trace": trace.name,
        "trace_requests_selected": trace.rounds, "mode": "sessions", "speedup": speedup,
        "concurrency": concurrency,
        "prompt_synthesis": (
            "token ids per session: a first round's header, shared system prompt and unique input; a follow-up "
            f"is its parent's prompt ids, the parent's simulated answer ids, {TURN_TOKENS} turn-boundary ids and "
            "its unique new input; the template trailer ends each"),
        "simulation": _simulation_meta(config, sim),
    }
    summary = summarize(records, wall_s=wall, slo=slo, cost=CostModel(cluster_gpus(config), gpu_hour_usd),
                        tiers=sim.stats.tiers(), hit_window_s=hit_window_s, meta=meta)
    summary.update(session_figures(records, [t.makespan_s for t in driver.timings],
                                   [t.service_s for t in driver.timings]))
    _write(out, records, summary)
    return records, summary
