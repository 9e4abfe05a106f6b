"""bench/chaos.py's short schedule: the compose topology on network namespaces (Redis, two
gateways, four sim workers and a spare, a client host), Redis SIGKILLed and restarted, a
worker replaced at a new address, a gateway killed, Redis's link cut for 10 s, under an
open-loop load. Needs root (`ip netns add`): it skips without it, except under CI=true, where
CI runs as root and a skip is a failure."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

from _netns import list_namespaces, netns_usable, run_name  # noqa: E402


def _netns_or_skip() -> None:
    why = netns_usable()
    if why is None:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"network namespaces unavailable under CI=true: {why}")
    pytest.skip(f"network namespaces unavailable: {why}")


@pytest.fixture(scope="module")
def chaos(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The short run's last-line JSON (one run for the module's tests)."""
    _netns_or_skip()
    logs = tmp_path_factory.mktemp("chaos-logs")
    with subprocess.Popen([sys.executable, str(REPO / "bench" / "chaos.py"), "--short", "--log-dir", str(logs)],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO) as run:
        try:
            stdout, stderr = run.communicate(timeout=560)
        except subprocess.TimeoutExpired:
            run.terminate()  # its hosts are removed on SIGTERM
            stdout, stderr = run.communicate(timeout=60)
    tails = "\n".join(f"== {p.name}\n{p.read_text(errors='replace')[-1500:]}" for p in sorted(logs.glob("*.log")))
    assert run.returncode == 0, f"{stdout[-3000:]}\n{stderr[-3000:]}\n{tails}"
    left = [ns for ns in list_namespaces() if ns.startswith(f"{run_name(run.pid)}-")]
    assert not left, f"the run left namespaces behind: {left}"
    result: dict[str, Any] = json.loads(stdout.strip().splitlines()[-1])
    return result


def _context(result: dict[str, Any]) -> str:
    return json.dumps({k: v for k, v in result.items() if k != "unauthenticated_worker_calls"})


@pytest.mark.timeout(600)
def test_every_request_is_answered_or_failed_explicitly(chaos: dict[str, Any]) -> None:
    context = _context(chaos)
    assert chaos["requests_total"] > 150, context
    assert chaos["requests_lost"] == 0, context
    assert chaos["requests_answered"] + chaos["requests_failed"] == chaos["requests_total"], context
    # The faults happened and the run saw them.
    assert chaos["worker_replacement"]["new_worker_healthy_on_both_s"] is not None, context
    assert chaos["worker_replacement"]["old_worker_out_of_routing_s"] is not None, context
    assert chaos["attempts_per_replica"]["gw1"] > 0 and chaos["attempts_per_replica"]["gw2"] > 0, context
    assert 0.5 < chaos["follow_up_hit_before_redis_kill"] <= 1, context  # prefix-aware routing works at all


@pytest.mark.timeout(600)
def test_state_survives_and_the_cluster_is_closed(chaos: dict[str, Any]) -> None:
    context = _context(chaos)
    assert chaos["keys_valid_after_redis_restart"] is True, context
    assert chaos["admin_changes_kept_after_redis_restart"] is True, context
    assert chaos["unauthenticated_worker_calls_refused"] is True, context
    assert chaos["unauthenticated_redis_refused"] is True, context
    assert chaos["index_hit_recovery_s"] is not None and chaos["index_hit_recovery_s"] <= 30, context
