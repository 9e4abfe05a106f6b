"""Closed-loop sessions in virtual time (simulate/sessions.py): schedule, prompts, hit rate."""

from __future__ import annotations

from pathlib import Path

import pytest

from deepinfer_gateway.simulate import ClusterConfig, load_cluster, run_simulation
from deepinfer_gateway.simulate.config import WorkerGroup
from deepinfer_gateway.simulate.gateway import RequestState
from deepinfer_gateway.simulate.sessions import TURN_TOKENS, SessionDriver
from deepinfer_gateway.simulate.simulator import Simulator
from deepinfer_gateway.workload.sessions import Round, Session, SessionTrace

ROOT = Path(__file__).resolve().parents[2]
UNIFIED = ClusterConfig(workers=(WorkerGroup(count=2),))


def _chain(sid: str, arrival: float, waits: list[float], new_input: int = 700, output: int = 40) -> Session:
    rounds: list[Round] = []
    for i, wait in enumerate(waits):
        parent = rounds[-1].key if rounds else None
        rounds.append(Round(f"{sid}/{i}", sid, i, new_input, output, parent, (parent,) if parent else (),
                            wait if parent else 0.0, (0, 3000) if i == 0 else None))
    return Session(sid, arrival, tuple(rounds))


class _Watched(SessionDriver):
    """Keeps each round's prompt and answer ids as the simulator ends it."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.seen: dict[int, tuple[list[int], list[int], float]] = {}

    def _ended(self, req: RequestState) -> None:
        self.seen[req.trace.index] = (list(req.tokens), req.output[: req.emitted], self.sim.now)
        super()._ended(req)


def test_a_follow_up_arrives_at_its_parents_finish_plus_its_wait_with_parent_prompt_and_answer() -> None:
    trace = SessionTrace("t", (_chain("a", 0.0, [0.0, 0.25, 1.5]), _chain("b", 0.1, [0.0, 0.5])))
    sim = Simulator(UNIFIED, speedup=1.0)
    driver = _Watched(sim, trace)
    records = driver.run()
    assert [r.session_id for r in records] == ["a", "a", "a", "b", "b"] and all(r.ok for r in records)
    assert records[0].arrival_s == 0.0 and records[3].arrival_s == pytest.approx(0.1)
    for parent, child, wait in ((0, 1, 0.25), (1, 2, 1.5), (3, 4, 0.5)):
        prompt, answer, end = driver.seen[parent]
        assert records[child].arrival_s == pytest.approx(end + wait)
        assert end == pytest.approx(records[parent].arrival_s + (records[parent].e2e_s or 0))
        child_prompt = driver.seen[child][0]
        assert len(answer) == 40
        assert child_prompt[: len(prompt) + len(answer)] == prompt + answer
        assert len(child_prompt) == len(prompt) + len(answer) + TURN_TOKENS + 700 + len(sim.prompts.trailer)
        assert records[child].planned_cached_tokens == len(prompt) + len(answer)
    # the shared system prompt: both sessions' first prompts agree past the header, then differ
    first_a, first_b = driver.seen[0][0], driver.seen[3][0]
    header = len(sim.prompts.header)
    assert first_a[: header + 3000] == first_b[: header + 3000] and first_a != first_b
    assert [t.session_id for t in driver.timings] == ["b", "a"]  # b ends first
    a = next(t for t in driver.timings if t.session_id == "a")
    assert a.makespan_s - a.service_s == pytest.approx(1.75)


def test_speedup_divides_arrivals_and_waits() -> None:
    trace = SessionTrace("t", (_chain("a", 2.0, [0.0, 1.0]),))
    sim = Simulator(UNIFIED, speedup=4.0)
    driver = _Watched(sim, trace)
    records = driver.run()
    assert records[0].arrival_s == pytest.approx(0.5)
    assert records[1].arrival_s == pytest.approx(driver.seen[0][2] + 0.25)


def test_concurrency_starts_a_session_as_one_ends() -> None:
    trace = SessionTrace("t", tuple(_chain(f"s{i}", 100.0 * i, [0.0, 0.2]) for i in range(3)))
    sim = Simulator(UNIFIED)
    driver = _Watched(sim, trace, concurrency=2)
    records = driver.run()
    assert records[0].arrival_s == records[2].arrival_s == 0.0  # two live at once, arrival times ignored
    first_end = min(driver.seen[1][2], driver.seen[3][2])
    assert records[4].arrival_s == pytest.approx(first_end)


def test_a_failed_parent_skips_its_descendants_as_dependency() -> None:
    # A prompt longer than the worker's whole KV memory is refused at admission.
    tiny = ClusterConfig(workers=(WorkerGroup(memory_capacity_blocks=20),),
                         store={"enabled": False})
    trace = SessionTrace("t", (_chain("a", 0.0, [0.0, 0.1, 0.1], new_input=4000),))
    records, summary = _run(tiny, trace)
    assert [r.status for r in records] == ["error"] * 3
    assert [r.error for r in records[1:]] == ["dependency", "dependency"]
    assert summary["sessions"] == 1  # as the live replay: a session whose first round was answered (an error)


def _run(config: ClusterConfig, trace: SessionTrace, concurrency: int | None = None) -> tuple[list, dict]:
    from deepinfer_gateway.simulate import run as run_module

    return run_module._run_sessions(config, trace, speedup=1.0, concurrency=concurrency, slo=None,
                                    gpu_hour_usd=None, hit_window_s=None, header_offset=True, out=None)


def test_follow_up_hit_rate_is_near_the_planned_rate_with_the_default_policy() -> None:
    config = load_cluster(ROOT / "bench" / "clusters" / "demo-pd.toml")
    _, summary = run_simulation(config, "synthetic:agent:loop=closed,sessions=16,seed=3", concurrency=4)
    assert summary["sessions"] == 16 and summary["errors"] == {}
    assert summary["planned_hit_rate"] > 0.8
    assert summary["follow_up_vs_planned"] >= 0.95
    assert summary["mode"] == "sessions" and summary["concurrency"] == 4
    assert set(summary["ttft_by_round"]) >= {"0", "1"}


def test_concurrency_is_refused_for_a_request_trace() -> None:
    with pytest.raises(ValueError, match="session workloads"):
        run_simulation(UNIFIED, "synthetic:chat:requests=5", concurrency=2)
