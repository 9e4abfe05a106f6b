"""simulate with `session_capacity`: the gateway's session capacity policy
(router/session_capacity.py) in virtual time. One worker whose cache holds one agent session's
context and not two: with the policy, the second session waits while the first is live and every
follow-up finds its context cached; without it, the two sessions evict each other's contexts.
Session rounds reach the planner with their session key (affinity holds them to their worker).
With two such workers both full, a third session's first round takes whichever frees room first."""

from __future__ import annotations

from pathlib import Path

from deepinfer_gateway.config import SessionCapacitySettings
from deepinfer_gateway.simulate import ClusterConfig
from deepinfer_gateway.simulate.config import StoreSettings, WorkerGroup
from deepinfer_gateway.simulate.sessions import SessionDriver
from deepinfer_gateway.simulate.simulator import Simulator
from deepinfer_gateway.workload.sessions import Round, Session, SessionTrace
from deepinfer_gateway.workload.types import RequestRecord
from tests.sim_profiles import small_sm100

PROFILE = small_sm100(memory_capacity_blocks=64)


def _session(sid: str, kind: int, arrival: float, rounds: int = 4) -> Session:
    """A chain of rounds 0.3 s apart: 5,000 tokens of system prompt of its own (kind), 600 new
    tokens a round, 30 out; its context grows from ~44 to ~59 of the worker's 64 blocks."""
    chain: list[Round] = []
    for i in range(rounds):
        parent = chain[-1].key if chain else None
        chain.append(Round(f"{sid}/{i}", sid, i, 600, 30, parent, (parent,) if parent else (), 0.3 if parent else 0.0,
                           (kind, 5000) if i == 0 else None))
    return Session(sid, arrival, tuple(chain))


TRACE = SessionTrace("two-sessions", (_session("a", 0, 0.0), _session("b", 1, 0.05)))


def _run(tmp_path: Path, capacity: SessionCapacitySettings, workers: int = 1, trace: SessionTrace = TRACE
         ) -> tuple[list[RequestRecord], Simulator]:
    profiles = tmp_path / "profiles.toml"
    profiles.write_text(PROFILE)
    config = ClusterConfig(profiles=str(profiles), workers=(WorkerGroup(count=workers),), session_capacity=capacity,
                           store=StoreSettings(enabled=False))  # memory only, as bench/peers.py's cluster
    sim = Simulator(config)
    return SessionDriver(sim, trace).run(), sim


def _follow_up_hit(records: list[RequestRecord]) -> float:
    follow = [r for r in records if r.round_idx]
    return sum(r.cached_tokens or 0 for r in follow) / sum(r.planned_cached_tokens or 0 for r in follow)


def test_the_second_session_waits_instead_of_evicting_the_live_one(tmp_path: Path) -> None:
    on, sim = _run(tmp_path, SessionCapacitySettings(enabled=True, ttl_ms=1000, max_wait_ms=30_000))
    off, _ = _run(tmp_path, SessionCapacitySettings(enabled=False))
    assert all(r.ok for r in on + off)
    assert sim.stats.session_waits == 1 and sim.stats.session_proceeded == 0
    # b's first round waited for a's whole chain (each tool wait within the TTL) and the TTL after it
    a_end = max(r.arrival_s + (r.e2e_s or 0) for r in on if r.session_id == "a")
    b_first = next(r for r in on if r.session_id == "b" and r.round_idx == 0)
    assert b_first.arrival_s + (b_first.ttft_s or 0) >= a_end + 1.0
    assert _follow_up_hit(on) > 0.95
    assert _follow_up_hit(off) < _follow_up_hit(on) - 0.2  # without it, each round evicted the other's context


def test_a_round_past_its_longest_wait_goes_anyway(tmp_path: Path) -> None:
    records, sim = _run(tmp_path, SessionCapacitySettings(enabled=True, ttl_ms=1000, max_wait_ms=500))
    assert all(r.ok for r in records)
    assert sim.stats.session_waits >= 1 and sim.stats.session_proceeded >= 1
    b_first = next(r for r in records if r.session_id == "b" and r.round_idx == 0)
    assert b_first.ttft_s is not None and 0.5 <= b_first.ttft_s < 1.5


def test_with_room_elsewhere_nothing_waits_and_each_session_keeps_its_worker(tmp_path: Path) -> None:
    records, sim = _run(tmp_path, SessionCapacitySettings(enabled=True), workers=2)
    assert all(r.ok for r in records) and sim.stats.session_waits == 0
    workers = {sid: {r.worker for r in records if r.session_id == sid} for sid in ("a", "b")}
    assert len(workers["a"]) == 1 and len(workers["b"]) == 1 and workers["a"] != workers["b"]
    assert _follow_up_hit(records) > 0.95


def test_a_round_cached_nowhere_takes_the_first_worker_that_frees_room(tmp_path: Path) -> None:
    # a (4 rounds) fills one worker, b (1 round) the other; c's first round finds no room on either
    trace = SessionTrace("three-sessions", (_session("a", 0, 0.0), _session("b", 1, 0.05, rounds=1),
                                            _session("c", 2, 0.1, rounds=2)))
    records, sim = _run(tmp_path, SessionCapacitySettings(enabled=True, ttl_ms=1000, max_wait_ms=30_000),
                        workers=2, trace=trace)
    assert all(r.ok for r in records)
    assert sim.stats.session_waits == 1 and sim.stats.session_proceeded == 0

    def end(sid: str) -> float:
        return max(r.arrival_s + (r.e2e_s or 0) for r in records if r.session_id == sid)

    worker = {sid: {r.worker for r in records if r.session_id == sid} for sid in "abc"}
    assert worker["c"] == worker["b"] != worker["a"]
    # c waited for b's TTL (~1.7 s), not for a's whole chain and its TTL (~4.1 s: a wait in a's
    # worker's line)
    assert 1.0 <= sim.stats.session_wait_s < 2.2
    c_first = next(r for r in records if r.session_id == "c" and r.round_idx == 0)
    assert end("b") + 1.0 <= c_first.arrival_s + (c_first.ttft_s or 0) < end("a")
    assert _follow_up_hit(records) > 0.95
