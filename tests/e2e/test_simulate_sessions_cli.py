"""`deepinfer-gateway simulate` on a closed-loop session workload, as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_simulate_sessions_prints_the_session_summary(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "deepinfer_gateway", "--log-level", "warning", "simulate",
         "--trace", "synthetic:agent:loop=closed,sessions=8,seed=2", "--cluster",
         str(ROOT / "bench" / "clusters" / "demo-unified.toml"), "--concurrency", "3", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["mode"] == "sessions" and summary["concurrency"] == 3 and summary["sessions"] == 8
    assert summary["errors"] == {}
    assert 0.9 <= summary["follow_up_vs_planned"] <= 1.0
    for key in ("follow_up_hit_rate", "planned_hit_rate", "session_makespan_s", "ttft_by_round"):
        assert summary[key], key
    written = json.loads((tmp_path / "summary.json").read_text())
    assert written["follow_up_hit_rate"] == summary["follow_up_hit_rate"]
    records = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert len(records) == summary["requests"] and all(r["session_id"] for r in records)


def test_simulate_refuses_concurrency_for_a_request_trace() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "deepinfer_gateway", "simulate", "--trace", "synthetic:chat:requests=5",
         "--cluster", str(ROOT / "bench" / "clusters" / "demo-unified.toml"), "--concurrency", "2"],
        capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode != 0 and "session workloads" in out.stderr
