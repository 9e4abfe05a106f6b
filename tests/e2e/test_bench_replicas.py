"""Smoke run of bench/replicas.py: 1 and 2 gateway replicas, a few two-turn sessions, shared
Redis state and the per-replica baseline; checks the last-line JSON and that every request
is accounted for."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ROW_KEYS = {"replicas", "mode", "sent", "ok", "errors", "lost", "duplicated", "follow_up_hit", "first_turn_hit",
            "ttft_p50_s", "ttft_p99_s", "worker_prompt_tokens_minus_client", "req_per_s", "session_waits",
            "session_proceeded"}


@pytest.mark.timeout(240)
def test_replicas_bench_smoke() -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "replicas.py"), "--replicas", "1,2", "--sessions", "4", "--turns", "2",
         "--session-interval-s", "0.2", "--think-s", "0.2", "--session-ids"],
        capture_output=True, text=True, timeout=220, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["replica_counts"] == [1, 2]
    assert result["nothing_lost_or_duplicated"] is True
    assert 0 < result["follow_up_hit_ratio_min"] <= 1 and result["ttft_p99_ratio_8_to_1"] > 0
    assert 0 < result["per_replica_follow_up_hit_ratio_min"] <= 1
    for mode, rows in (("shared", result["rows"]), ("per_replica", result["per_replica_rows"])):
        assert [r["replicas"] for r in rows] == [1, 2]
        for row in rows:
            assert set(row) == ROW_KEYS and row["mode"] == mode
            assert row["sent"] == row["ok"] == 8 and row["errors"] == row["lost"] == row["duplicated"] == 0
            assert row["worker_prompt_tokens_minus_client"] == 0
            assert row["session_waits"] == row["session_proceeded"] == 0  # session capacity is off
            # A follow-up turn resends the whole first turn: most of it is cached somewhere it was routed.
            assert row["follow_up_hit"] > 0.5 and row["follow_up_hit"] > row["first_turn_hit"]
            assert 0 < row["ttft_p50_s"] <= row["ttft_p99_s"]
