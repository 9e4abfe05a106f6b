"""The offline simulator: config, token layout, exactness of steady stretches, runs, CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from deepinfer_gateway.kvcache.hashing import block_hashes, kv_salt, pack_tokens
from deepinfer_gateway.process.cli import main as cli_main
from deepinfer_gateway.simulate import ClusterConfig, load_cluster, run_simulation
from deepinfer_gateway.simulate import simulator as simulator_module
from deepinfer_gateway.simulate.config import WorkerGroup
from deepinfer_gateway.simulate.tokens import HEADER_TOKENS, PromptTokens
from deepinfer_gateway.workload.types import Trace, TraceRequest
from tests.shared_data import CONVERSATION, needs_shared

CLUSTERS = Path(__file__).resolve().parents[2] / "bench" / "clusters"


def _trace(n: int = 60, seed: int = 3) -> Trace:
    """Multi-turn-ish: sessions re-send their previous blocks plus new ones."""
    import random

    rng = random.Random(seed)
    sessions: list[list[int]] = [[0] for _ in range(8)]
    next_id = 1
    requests = []
    for i in range(n):
        ids = sessions[rng.randrange(len(sessions))]
        for _ in range(rng.randint(1, 6)):
            ids.append(next_id)
            next_id += 1
        length = 512 * (len(ids) - 1) + rng.randint(1, 512)
        requests.append(TraceRequest(i, i * 0.15, length, rng.randint(1, 200), tuple(ids)))
    return Trace("synthetic-test", tuple(requests))


def test_cluster_files_load_and_validate() -> None:
    for path in CLUSTERS.glob("*.toml"):
        assert load_cluster(path).worker_count >= 3
    assert load_cluster(CLUSTERS / "pd-128.toml").worker_count == 128
    with pytest.raises(ValidationError, match="prefill and decode"):
        ClusterConfig(workers=(WorkerGroup(role="prefill"),))
    with pytest.raises(ValidationError):
        ClusterConfig(workers=(WorkerGroup(),), bogus=1)  # type: ignore[call-arg]


def test_equal_hash_ids_give_equal_block_hashes_after_the_header() -> None:
    prompts = PromptTokens()
    a = prompts.prompt(TraceRequest(0, 0.0, 1500, 4, (7, 8, 9)))
    b = prompts.prompt(TraceRequest(1, 0.0, 1500, 4, (7, 8, 10)))
    c = prompts.prompt(TraceRequest(2, 0.0, 1500, 4, (7, 11, 10)))
    assert len(a) == 1500 + 30 and a[:HEADER_TOKENS] == b[:HEADER_TOKENS]
    salt = kv_salt("m", "f")
    ha, hb, hc = (block_hashes(x, salt) for x in (a, b, c))
    # Blocks 0..7 (positions < 28 + 1024) hold header + ids 7, 8 in a and b; block 8 straddles id 9/10.
    assert ha[:8] == hb[:8] and ha[8] != hb[8]
    # c shares only the header + id 7: gateway blocks 0..3 (positions < 512) and block 4 straddles 7/11.
    assert ha[:4] == hc[:4] and ha[4] != hc[4]
    assert PromptTokens(header=False).prompt(TraceRequest(0, 0.0, 600, 1, (7, 8)))[:3] == [14, 0, 0]


def test_steady_stretches_match_step_by_step(monkeypatch: pytest.MonkeyPatch) -> None:
    config = load_cluster(CLUSTERS / "demo-pd.toml")
    trace = _trace()
    fast, fast_summary = run_simulation(config, trace, speedup=4.0)
    monkeypatch.setattr(simulator_module, "CRUISE_MIN_STEPS", 10**9)
    slow, slow_summary = run_simulation(config, trace, speedup=4.0)
    assert fast_summary["simulation"]["steps"] == slow_summary["simulation"]["steps"]
    assert fast_summary["simulation"]["heap_events"] < slow_summary["simulation"]["heap_events"]
    for f, s in zip(fast, slow, strict=True):
        assert (f.worker, f.cached_tokens, f.output_tokens, len(f.itl_s)) == (s.worker, s.cached_tokens,
                                                                               s.output_tokens, len(s.itl_s))
        assert f.ttft_s == pytest.approx(s.ttft_s, abs=1e-9) and f.e2e_s == pytest.approx(s.e2e_s, abs=1e-9)
        assert f.itl_s == pytest.approx(s.itl_s, abs=1e-9)


@pytest.mark.parametrize("cluster", ["demo-pd.toml", "demo-unified.toml"])
def test_run_produces_bench_summary_and_is_deterministic(cluster: str, tmp_path: Path) -> None:
    config = load_cluster(CLUSTERS / cluster)
    trace = _trace()
    records, summary = run_simulation(config, trace, speedup=2.0, out=tmp_path)
    again, _ = run_simulation(config, trace, speedup=2.0)
    assert [r.to_dict() for r in records] == [r.to_dict() for r in again]
    assert summary["requests"] == summary["completed"] == len(trace.requests) and summary["errors"] == {}
    for key in ("ttft_s", "itl_s", "tpot_s", "e2e_s"):
        assert summary[key]["p50"] > 0
    assert all(r.prompt_tokens == r.expected_input_tokens + 30 for r in records)
    assert all(r.output_tokens == r.expected_output_tokens for r in records)
    cache = summary["cache_hit_rate"]
    assert 0 < cache["total"] <= summary["oracle_hit_rate"] + 0.02
    assert cache["memory"] + cache["store"] == pytest.approx(cache["total"])
    assert json.loads((tmp_path / "summary.json").read_text())["requests"] == len(trace.requests)
    assert len((tmp_path / "results.jsonl").read_text().splitlines()) == len(trace.requests)
    modes = summary["simulation"]["modes"]
    assert set(modes) <= ({"pd", "bypass"} if "pd" in cluster else {"unified"})


def test_policy_changes_routing() -> None:
    config = load_cluster(CLUSTERS / "demo-unified.toml")
    rr = config.model_copy(update={"router": config.router.with_policies("round_robin")})
    _, ttft = run_simulation(config, _trace(), speedup=2.0)
    _, robin = run_simulation(rr, _trace(), speedup=2.0)
    assert sorted(robin["workers"].values()) == [20, 20, 20]
    assert ttft["cache_hit_rate"]["total"] > robin["cache_hit_rate"]["total"]


@pytest.mark.parametrize(("policy", "message"), [
    ("fastest", "argument --policy: unknown routing policy 'fastest'; choose one of "),
    ('{"name": "cache_aware", "min_match": 2}', "argument --policy: min_match: Input should be less than or equal"),
    ('{"name": "cache_aware",', "argument --policy: Expecting"),
])
def test_cli_simulate_checks_the_policy_before_anything_runs(capsys: pytest.CaptureFixture[str], policy: str,
                                                              message: str) -> None:
    with pytest.raises(SystemExit) as e:  # the cluster file does not exist: the policy is checked first
        cli_main(["simulate", "--trace", "synthetic:chat", "--cluster", "/nonexistent.toml", "--policy", policy])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_cli_simulate_takes_a_policy_table(capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli_main(["--log-level", "warning", "simulate", "--trace", "synthetic:chat:requests=20", "--cluster",
                   str(CLUSTERS / "demo-unified.toml"), "--policy", '{"name": "power_of_two", "choices": 3}'])
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and last["requests"] == 20 and last["simulation"]["policy"] == "power_of_two"


def test_too_long_prompt_is_an_error_not_a_crash() -> None:
    config = load_cluster(CLUSTERS / "demo-unified.toml")
    trace = Trace("long", (TraceRequest(0, 0.0, 200_000, 5, None), TraceRequest(1, 0.1, 1000, 5, None)))
    records, summary = run_simulation(config, trace)
    assert records[0].error == "http_4xx" and records[1].ok and summary["completed"] == 1


@needs_shared(CONVERSATION)
def test_cli_simulate_prints_summary_last(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli_main(["--log-level", "warning", "simulate", "--trace", str(CONVERSATION), "--cluster",
                   str(CLUSTERS / "demo-pd.toml"), "--max-requests", "40", "--speedup", "4", "--out", str(tmp_path),
                   "--policy", "cache_aware"])
    assert rc == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["requests"] == 40 and last["simulation"]["policy"] == "cache_aware"
    assert last["oracle_hit_rate"] == pytest.approx(0.0336, abs=0.02)
    assert (tmp_path / "summary.json").exists()


def test_packed_prompt_is_the_prompt_as_block_hashing_packs_it() -> None:
    """The simulator hands the gateway's hasher the prompt already packed (as the live
    encoder does): it must be byte for byte what packing the token ids gives."""
    for header in (True, False):
        prompts = PromptTokens(512, header=header)
        for request in (TraceRequest(0, 0.0, 1500, 4, (7, 8, 9)), TraceRequest(1, 0.0, 1025, 4, (7, 123_456_789, 3)),
                        TraceRequest(2, 0.0, 2, 1, (5,)), TraceRequest(3, 0.0, 700, 1, None),
                        TraceRequest(4, 0.0, 0, 1, ()), TraceRequest(5, 0.0, 1024, 1, (1, 2))):
            assert prompts.packed(request) == pack_tokens(prompts.prompt(request))
