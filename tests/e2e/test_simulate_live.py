"""The simulator against a live HTTP replay of the same trace slice on a demo-like PD cluster.

(a) `bench` (OpenAI SDK, streaming) -> gateway -> sim-cluster (2 sm100 + 1 ascend950 per
pool, real time x TIME_SCALE), LIVE_REPLAYS times on a cold cluster, TTFT p50 taken as
the median of theirs; (b) `run_simulation` on the same shape, speedup and time scale,
with the gateway's per-request cost measured on this machine before each live replay
(the median of those; `measure_gateway_cost`: preparation, tokenization, hashing, worker
parsing; and the prompt length from which the gateway prepares in its thread,
`offload_tokens`), first tokens held while the gateway's event loop prepares
(`GatewayCost.relay_waits`), and TTFT p50 taken as the median over SEEDS jittered replays.
Asserts: hit rate within 2 points, TTFT p50 within 15%.

Output lengths are capped at OUTPUT_CAP tokens in both runs: token relay costs CPU in
three processes (worker, gateway, SDK client) on a 2-core machine, which slows the live
cluster's step loops and is not what this compares (TTFT and hit rate of PD prefill do
not depend on output length; docs/simulate.md).
"""

from __future__ import annotations

import gzip
import json
import statistics
from pathlib import Path

import pytest

from deepinfer_gateway.loadgen.replay import ReplayConfig
from deepinfer_gateway.loadgen.run import BenchConfig, run_bench
from deepinfer_gateway.simulate import ClusterConfig, run_simulation
from deepinfer_gateway.simulate.calibrate import measure_gateway_cost
from deepinfer_gateway.simulate.config import GatewayCost, WorkerGroup
from harness.launch import Gateway, SimCluster
from tests.shared_data import CONVERSATION, require

WORKERS = "prefill:sm100,prefill:sm100,prefill:ascend950,decode:sm100,decode:sm100,decode:ascend950"
REQUESTS, SPEEDUP, TIME_SCALE, OUTPUT_CAP = 120, 2.5, 0.25, 32
HEALTH_INTERVAL_S = 0.2
# The simulated TTFT p50 is the median over SEEDS replays with the gateway's per-request cost
# jittered by JITTER (lognormal sigma; back-to-back calibrations on this machine spread by
# ~15%): a single deterministic replay of this burst-heavy slice jumps by up to +-20% with a
# few percent change in gateway cost (routing ties flip), while the ensemble moves smoothly.
SEEDS, JITTER = 9, 0.2
# The live side is one draw of the same chaotic system: single live replays of this slice
# measured 1.24-1.58 s on this machine kind (sims of their calibrations: medians 1.39-1.54 s),
# and CI failed twice on a single replay (ratios 0.85 and 1.17). The test compares the median of LIVE_REPLAYS
# replays, each on a cold cluster and each preceded by a calibration (the median cost is
# simulated), with the median of the SEEDS simulations.
LIVE_REPLAYS = 3
# 120 requests, not 60: the p50 of the first 60 is bimodal (seeded sims 1.22-1.51 s; a CI run
# measured live 1.70 vs sim 1.44), the first 120 spread 1.38-1.51 s (docs/simulate.md).


def _slice(tmp: Path) -> str:
    out = []
    with gzip.open(CONVERSATION, "rt") as f:
        for _, line in zip(range(REQUESTS), f, strict=False):
            row = json.loads(line)
            row["output_length"] = min(row["output_length"], OUTPUT_CAP)
            out.append(json.dumps(row))
    path = tmp / "slice.jsonl"
    path.write_text("\n".join(out) + "\n")
    return str(path)


def _live_replay(tmp: Path, trace: str) -> dict:
    """One `bench` replay of `trace` onto a fresh (cold-cache) sim-cluster and gateway."""
    tmp.mkdir()
    cluster = SimCluster(WORKERS, time_scale=TIME_SCALE)
    gateway = None
    try:
        gateway = Gateway(tmp, [(url, *spec.split(":")) for url, spec in zip(cluster.urls, cluster.specs, strict=True)],  # type: ignore[misc]
                          health_interval_s=HEALTH_INTERVAL_S)
        gateway.wait_ready(len(cluster.specs))
        return run_bench(BenchConfig(url=gateway.url, trace=trace, out=tmp, ignore_eos=True, plots=False,
                                     replay=ReplayConfig(mode="open", speedup=SPEEDUP, progress=False)))
    finally:
        if gateway is not None:
            gateway.stop()
        cluster.stop()


def _median_cost(costs: list[GatewayCost]) -> GatewayCost:
    return costs[0].model_copy(update={
        "request_overhead_s": statistics.median(c.request_overhead_s for c in costs),
        "per_prompt_token_s": statistics.median(c.per_prompt_token_s for c in costs)})


@pytest.fixture(scope="module")
def live_and_sim(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """LIVE_REPLAYS live replays and SEEDS simulations of the same slice, shared by the assertions below."""
    require(CONVERSATION)
    tmp_path = tmp_path_factory.mktemp("simlive")
    trace = _slice(tmp_path)
    costs, lives = [], []
    for k in range(LIVE_REPLAYS):  # calibrated before each replay: the machine's speed drifts
        costs.append(measure_gateway_cost())
        lives.append(_live_replay(tmp_path / f"live{k}", trace))
    cost = _median_cost(costs)
    groups = tuple(WorkerGroup(role=s.split(":")[0], hardware=s.split(":")[1]) for s in WORKERS.split(","))
    config = ClusterConfig(workers=groups, time_scale=TIME_SCALE, load_report_interval_s=HEALTH_INTERVAL_S,
                           gateway=cost.model_copy(update={"jitter": JITTER}))
    _, sim = run_simulation(config, trace, speedup=SPEEDUP, out=tmp_path / "sim")
    sim_p50s = [sim["ttft_s"]["p50"]]
    for seed in range(1, SEEDS):
        seeded = config.model_copy(update={"gateway": config.gateway.model_copy(update={"seed": seed})})
        sim_p50s.append(run_simulation(seeded, trace, speedup=SPEEDUP)[1]["ttft_s"]["p50"])
    live_p50s = [live["ttft_s"]["p50"] for live in lives]
    live_p50, sim_p50 = statistics.median(live_p50s), statistics.median(sim_p50s)
    # Key figures first: a failed assertion prints this dict, truncated.
    figures = {"ratio": sim_p50 / live_p50, "live_ttft_p50": live_p50, "sim_ttft_p50": sim_p50,
               "live_ttft_p50_per_replay": live_p50s,
               "per_prompt_token_us": [c.per_prompt_token_s * 1e6 for c in costs],
               "live_hit": [live["cache_hit_rate"]["total"] for live in lives],
               "sim_hit": sim["cache_hit_rate"]["total"], "sim_ttft_p50_per_seed": sim_p50s,
               "gateway_cost": cost.model_dump()}
    print(json.dumps(figures))
    return {"lives": lives, "sim": sim, "live_ttft_p50": live_p50, "sim_ttft_p50": sim_p50, "figures": figures}


def test_simulator_matches_live_requests_and_hit_rate(live_and_sim: dict) -> None:
    sim, figures = live_and_sim["sim"], live_and_sim["figures"]
    assert sim["completed"] == REQUESTS
    for live in live_and_sim["lives"]:
        assert live["completed"] == REQUESTS
        assert live["tokens"]["prompt"] == sim["tokens"]["prompt"]  # same prompts, token for token in length
        assert abs(live["cache_hit_rate"]["total"] - sim["cache_hit_rate"]["total"]) <= 0.02, figures


def test_simulator_matches_live_ttft(live_and_sim: dict) -> None:
    assert live_and_sim["sim_ttft_p50"] == pytest.approx(live_and_sim["live_ttft_p50"], rel=0.15), \
        live_and_sim["figures"]
