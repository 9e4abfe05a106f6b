"""Smoke run of bench/policies.py: 20 trace requests x 2 policies x 1 cluster config, cold
cluster per run, through the live gateway; checks the last-line JSON's keys and that every
request is accounted for."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from tests.shared_data import CONVERSATION, needs_shared

REPO = Path(__file__).resolve().parents[2]
ROW_KEYS = {"hit_rate", "hit_rate_memory", "hit_rate_store", "ttft_p50_s", "ttft_p99_s", "itl_p50_s",
            "load_max_over_mean", "requests", "errors", "lost"}


def _module():
    spec = importlib.util.spec_from_file_location("bench_policies", REPO / "bench" / "policies.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def test_load_stats_max_over_mean() -> None:
    stats = _module().load_stats({"a": [0, 0, 30, 30, 0], "b": [0, 10, 10, 10, 0], "c": [0, 0, 20, 20, 0]})
    # idle rounds at both ends are dropped: means 20, 10, 13.3 -> max/mean = 20 / 14.44
    assert stats["load_max_over_mean"] == pytest.approx(20 / ((20 + 10 + 40 / 3) / 3))
    assert stats["busy_fraction"]["b"] == 1.0


def test_memory_blocks_auto_scales_hbm_by_the_speedup() -> None:
    m = _module()
    assert m.hbm_blocks() == 1_404_494  # 160 GB / (890 B x 128)
    assert m.memory_blocks_for("auto", 17) == 1_404_494 // 17
    assert m.memory_blocks_for("0", 17) is None and m.memory_blocks_for("5000", 17) == 5000


@pytest.mark.timeout(120)
@needs_shared(CONVERSATION)
def test_policies_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    m = _module()
    rc = m.main(["--trace", str(CONVERSATION), "--requests", "20", "--policies", "round_robin,estimated_ttft",
                 "--configs", "tiered", "--time-scale", "2", "--out", str(tmp_path)])
    assert rc == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    result = json.loads(last)
    assert 0 < result["oracle_hit_rate"] < 1
    tiered = result["configs"]["tiered"]
    assert set(tiered["policies"]) == {"round_robin", "estimated_ttft"}
    assert tiered["prefill_utilization_round_robin"] > 0
    for row in tiered["policies"].values():
        assert set(row) == ROW_KEYS
        assert row["requests"] == 20 and row["errors"] == 0 and row["lost"] == 0
        assert 0 <= row["hit_rate_memory"] <= row["hit_rate"] <= 1
        assert row["ttft_p50_s"] > 0 and row["ttft_p99_s"] >= row["ttft_p50_s"]
    details = json.loads((tmp_path / "policies.json").read_text())["details"]["tiered"]
    for d in details.values():
        assert d["sent"] == d["ok"] == 20 and d["duplicates"] == 0 and d["worker_prompt_tokens_excess"] == 0
