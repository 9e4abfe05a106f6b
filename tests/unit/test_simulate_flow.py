"""simulate with `flow_control`: the gateway's flow-control policy (router/flow.py) in virtual time.
Under 1.5x the capacity of a small worker, half the requests flex: the default half keeps its TTFT
target while flex waits or is refused; without flow control the engine's queue delays both."""

from __future__ import annotations

from pathlib import Path

import pytest

from deepinfer_gateway.config import FlowControlSettings, HardwareCost, RouterSettings
from deepinfer_gateway.simulate import ClusterConfig
from deepinfer_gateway.simulate.config import WorkerGroup
from deepinfer_gateway.simulate.simulator import Simulator
from deepinfer_gateway.workload.types import RecordError, RequestRecord, TraceRequest
from tests.sim_profiles import small_sm100

# 4 sequences of 30 tokens at 60 tokens/s: ~8 requests/s; 12/s arrive, every second one flex
TRACE = [TraceRequest(i, i / 12.0, 512, 30, (10_000 + 10 * i, 10_001 + 10 * i)) for i in range(150)]


def run(tmp_path: Path, enabled: bool, flex_share: float = 1.0, trace: list[TraceRequest] = TRACE,
        scheduling_policy: str = "fcfs") -> list[RequestRecord]:
    profiles = tmp_path / "profiles.toml"
    profiles.write_text(small_sm100(scheduling_policy=scheduling_policy))
    config = ClusterConfig(
        profiles=str(profiles), workers=(WorkerGroup(count=1),), flex_every=2,
        router=RouterSettings(hardware={"sm100": HardwareCost(prefill_tokens_per_s=20_000.0,
                                                              kv_load_bytes_per_s=25e9)}),
        flow_control=FlowControlSettings(enabled=enabled, max_engine_waiting=2, default_ttft_ms=2000,
                                         flex_ttft_ms=3000, flex_max_share=flex_share))
    return Simulator(config).run(trace)


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[int(0.99 * (len(ordered) - 1))]


@pytest.mark.parametrize("enabled", [True, False])
def test_default_keeps_its_target_while_flex_waits_or_is_refused(tmp_path: Path, enabled: bool) -> None:
    records = run(tmp_path, enabled)
    default = [r for r in records if r.index % 2 == 0]
    flex = [r for r in records if r.index % 2 == 1]
    default_ttft = [r.ttft_s for r in default if r.ttft_s is not None]
    if enabled:
        assert len(default_ttft) == len(default)  # none refused, none lost
        assert p99(default_ttft) < 2.0
        refused = [r for r in flex if r.error == RecordError.RATE_LIMITED]
        assert refused and all(r.ttft_s is None for r in refused)  # refused before any token
        assert len(refused) < len(flex)  # the rest served in the room default leaves
    else:
        assert p99(default_ttft) > 2.0  # the engine's queue holds flex and default alike
        assert not any(r.error == RecordError.RATE_LIMITED for r in records)


# 4 requests/s, every second one flex: default answers of 30 tokens (about one slot busy), flex
# answers of 120 (2 s each: flex alone fills the 4 slots and its queue grows)
LONG_FLEX = [TraceRequest(i, i / 4.0, 512, 120 if i % 2 else 30, (20_000 + 10 * i, 20_001 + 10 * i))
             for i in range(120)]


def test_flex_share_keeps_slots_free_for_default(tmp_path: Path) -> None:
    """Flex held to half the worker's 4 slots: default requests find a free slot instead of waiting
    for a flex answer to end, at the price of flex throughput."""
    def default_p99(records: list[RequestRecord]) -> float:
        return p99([r.ttft_s for r in records if r.index % 2 == 0 and r.ttft_s is not None])

    def flex_served(records: list[RequestRecord]) -> int:
        return sum(r.index % 2 == 1 and r.ttft_s is not None for r in records)

    shared, unshared = run(tmp_path, True, 0.5, LONG_FLEX), run(tmp_path, True, 1.0, LONG_FLEX)
    assert default_p99(shared) < 0.5 * default_p99(unshared), (default_p99(shared), default_p99(unshared))
    assert 0 < flex_served(shared) < flex_served(unshared)


def test_where_the_engine_preempts_flex_takes_every_slot_and_default_keeps_its_start(tmp_path: Path) -> None:
    """The worker preempts by priority: flex runs with no share (the tiers above take slots back as
    they need them), so default starts as with the share while flex is served as without it."""
    def default_p99(records: list[RequestRecord]) -> float:
        return p99([r.ttft_s for r in records if r.index % 2 == 0 and r.ttft_s is not None])

    def flex_served(records: list[RequestRecord]) -> int:
        return sum(r.index % 2 == 1 and r.ttft_s is not None for r in records)

    preempting = run(tmp_path, True, 0.5, LONG_FLEX, scheduling_policy="priority")
    shared, unshared = run(tmp_path, True, 0.5, LONG_FLEX), run(tmp_path, True, 1.0, LONG_FLEX)
    assert default_p99(preempting) <= default_p99(shared) * 1.5, (default_p99(preempting), default_p99(shared))
    assert flex_served(preempting) >= flex_served(unshared) > flex_served(shared)
