"""bench/overload.py's figures: goodput against the tenants' targets, shed and lost, the summary's ratios."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_PATH = Path(__file__).resolve().parents[2] / "bench" / "overload.py"
_spec = importlib.util.spec_from_file_location("overload", _PATH)
assert _spec is not None and _spec.loader is not None
overload = importlib.util.module_from_spec(_spec)
sys.modules["overload"] = overload
_spec.loader.exec_module(overload)

SPEC = overload.Spec(workers=2, decode_tps=30.0, max_num_seqs=4, output_tokens=30, alone_s=10.0, flood_s=10.0,
                     flood_x=2.5, interactive_x=0.25, agent_sessions=1,
                     targets_s={"interactive": 2.0, "agent": 4.0, "batch": 60.0}, seed=1)


def phase(outcomes: list[tuple[str, int, float]], seconds: float = 20.0) -> object:
    p = overload.Phase(seconds=seconds)
    p.outcomes = [overload.Outcome(tenant, status, ttft, 0.04) for tenant, status, ttft in outcomes]
    return p


def test_capacity_and_goodput_count_only_requests_within_their_targets() -> None:
    assert SPEC.capacity_rps == 8.0
    figures = overload.figures(phase([("interactive", 200, 0.5), ("interactive", 200, 3.0), ("interactive", 429, 0),
                                      ("batch", 200, 30.0), ("batch", 0, 0), ("agent", 200, 1.0)]), SPEC, 10.0)
    assert figures["interactive"]["goodput_rps"] == 0.1 and figures["interactive"]["good_share"] == 0.3333
    assert figures["interactive"]["shed"] == 1 and figures["interactive"]["lost"] == 0
    assert figures["goodput_rps"] == round(3 / 20.0, 3)  # the cluster's over the phase, drain included
    assert figures["lost"] == 1


def test_summary_ratios_are_flow_control_over_alone_and_the_best_peer() -> None:
    alone = phase([("interactive", 200, 0.2)] * 10, 10.0)
    flood_flow = phase([("interactive", 200, 0.3)] * 10 + [("batch", 200, 10.0)] * 40 + [("agent", 429, 0)], 20.0)
    flood_peer = phase([("interactive", 200, 9.0)] * 10 + [("batch", 200, 10.0)] * 20, 20.0)
    rows = [{"target": "gateway-flow", "alone": overload.figures(alone, SPEC, 10.0),
             "flood": overload.figures(flood_flow, SPEC, 10.0)},
            {"target": "sglang-router", "alone": overload.figures(alone, SPEC, 10.0),
             "flood": overload.figures(flood_peer, SPEC, 10.0)}]
    result = overload.summary(rows)
    assert result["interactive_ttft_p99_flood_vs_alone"] == 1.5
    assert result["interactive_goodput_flood_vs_alone"] == 1.0
    assert result["goodput_vs_best_peer"] == round(2.5 / 1.0, 3)
    assert result["goodput_vs_no_flow_control"] is None  # the gateway without flow control did not run
    assert result["shed_non_flex"] == 1 and result["lost"] == 0
