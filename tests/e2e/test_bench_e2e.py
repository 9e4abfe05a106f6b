"""End to end: `bench` through the real SDKs -> gateway -> sim workers (session fixtures)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deepinfer_gateway.loadgen.replay import ReplayConfig
from deepinfer_gateway.loadgen.report import load_summaries, table
from deepinfer_gateway.loadgen.run import BenchConfig, run_bench
from deepinfer_gateway.process.cli import main as cli_main
from deepinfer_gateway.workload.summary import CostModel, Slo
from deepinfer_gateway.workload.types import read_records
from tests.shared_data import CONVERSATION, needs_shared


@needs_shared(CONVERSATION)
def test_bench_replays_a_trace_slice_through_the_gateway(gateway, tmp_path: Path) -> None:
    out = tmp_path / "conv"
    config = BenchConfig(url=gateway.url, trace=str(CONVERSATION), out=out, max_requests=20,
                         replay=ReplayConfig(mode="open", speedup=40.0, progress=False),
                         slo=Slo(ttft_s=5.0, tpot_s=0.5), cost=CostModel(gpus=3, gpu_hour_usd=2.0))
    summary = run_bench(config)
    on_disk = json.loads((out / "summary.json").read_text())
    assert on_disk == json.loads(json.dumps(summary))
    assert summary["requests"] == 20 and summary["completed"] == 20 and summary["errors"] == {}
    for key in ("ttft_s", "itl_s", "tpot_s", "e2e_s"):
        assert set(summary[key]) >= {"p50", "p90", "p99"}
    assert summary["ttft_s"]["p50"] > 0 and summary["throughput"]["requests_per_s"] > 0
    records = read_records(out / "results.jsonl")
    assert [r.index for r in records] == list(range(20))
    # prompt = trace input_length + the template's 28-token header and 2-token trailer
    assert all(r.prompt_tokens == r.expected_input_tokens + 30 for r in records)
    assert all(r.worker for r in records)
    cache = summary["cache_hit_rate"]
    assert cache["reported_by_server"] and 0 < cache["total"] < 1
    assert cache["memory"] is not None and cache["store"] is not None  # from the gateway's /metrics
    assert summary["oracle_hit_rate"] == pytest.approx(0.0336, abs=1e-3)
    assert summary["cost"]["usd_per_million_output_tokens"] > 0
    assert summary["client_cpu"]["per_request_ms"] > 0
    assert (out / "ttft_cdf.png").exists() and (out / "hit_rate.png").exists()


@pytest.mark.parametrize("protocol", ["responses", "messages"])
def test_bench_cli_other_protocols_closed_loop(gateway, tmp_path: Path, protocol: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / protocol
    rc = cli_main(["bench", "--url", gateway.url + "/v1", "--protocol", protocol, "--trace",
                   "synthetic:chat:requests=6,seed=1", "--concurrency", "3", "--out", str(out),
                   "--no-progress", "--no-plots", "--percentiles", "95,50"])
    assert rc == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["protocol"] == protocol and last["completed"] == 6 and last["concurrency"] == 3
    assert last["cache_hit_rate"]["total"] is not None
    assert last["statistics"]["percentiles"] == [50, 95] and last["ttft_s"]["count"] == 6
    assert last["ttft_s"]["min"] <= last["ttft_s"]["p95"] <= last["ttft_s"]["max"]
    assert all(r.output_tokens and r.prompt_tokens for r in read_records(out / "results.jsonl"))
    assert "hit rate total" in table(load_summaries([out])) and "TTFT p95 s" in table(load_summaries([out]))


def test_bench_cli_refuses_bad_percentiles(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli_main(["bench", "--url", "http://127.0.0.1:9", "--trace", "synthetic:chat", "--out", str(tmp_path),
                  "--percentiles", "50,101"])
    assert exc.value.code == 2 and "--percentiles '50,101': 101 is outside 0..100" in capsys.readouterr().err


@needs_shared(CONVERSATION)
def test_lean_client_records_what_the_sdk_records(gateway, tmp_path: Path) -> None:
    """The lean SSE client (no SDK) fills the same fields, with the same token counts, at less CPU."""
    runs = {}
    for lean in (False, True):
        config = BenchConfig(url=gateway.url, trace=str(CONVERSATION), out=tmp_path / str(lean), max_requests=12,
                             replay=ReplayConfig(mode="open", speedup=40.0, progress=False), plots=False,
                             ignore_eos=True, lean_client=lean)
        runs[lean] = (run_bench(config), read_records(tmp_path / str(lean) / "results.jsonl"))
    (sdk, sdk_records), (lean, lean_records) = runs[False], runs[True]  # type: ignore[assignment]
    assert lean["completed"] == sdk["completed"] == 12
    for a, b in zip(sdk_records, lean_records, strict=True):
        assert (b.prompt_tokens, b.output_tokens, b.http_status) == (a.prompt_tokens, a.output_tokens, 200)
        assert b.output_tokens == b.expected_output_tokens and b.cached_tokens is not None
        # chunk counts may differ: the sim groups tokens of back-to-back steps by timing
        assert b.worker and b.ttft_s is not None and b.reasoning == a.reasoning
    assert lean["client_cpu"]["per_request_ms"] < sdk["client_cpu"]["per_request_ms"]
