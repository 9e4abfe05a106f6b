"""Closed-loop sessions: the three trace formats, the round schedule and the session figures."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Sequence
from pathlib import Path

import orjson
import pytest

from deepinfer_gateway.loadgen.sessions import SessionReplayConfig, replay_sessions
from deepinfer_gateway.loadgen.turns import ToolCall, Turn
from deepinfer_gateway.workload.sessions import (
    Round,
    SessionFormatError,
    agent_sessions,
    is_session_spec,
    load_sessions,
    parse_sessions,
)
from deepinfer_gateway.workload.summary import session_figures
from deepinfer_gateway.workload.types import RecordError, RequestRecord
from tests.shared_data import TRACELAB, needs_shared

CSV = """session_id,arrival_time,round_idx,prefix_len,input_len,output_len,tool_wait_after_ms
s1,0,0,100,512,64,250
s1,0,1,676,128,32,0
s0,2000,1,700,10,5,0
s0,2000,0,0,300,20,1000
"""


def test_tracelab_csv_is_a_chain_per_session_in_arrival_order() -> None:
    trace = parse_sessions(CSV, "t.csv")
    assert trace is not None
    assert [s.id for s in trace.sessions] == ["s1", "s0"]
    s1, s0 = trace.sessions
    assert s0.arrival_s == 2.0 and s1.arrival_s == 0.0
    first, second = s1.rounds
    # A first round's prefix_len is context the session starts with: sent as part of its input.
    assert (first.new_input_tokens, first.output_tokens, first.parent, first.wait_for) == (612, 64, None, ())
    assert (second.new_input_tokens, second.parent, second.wait_for) == (128, first.key, (first.key,))
    assert second.wait_s == pytest.approx(0.25)  # the wait after round 0
    assert [r.index for r in s0.rounds] == [0, 1] and s0.rounds[0].new_input_tokens == 300
    assert s0.rounds[1].wait_s == pytest.approx(1.0)


def test_dynamo_agentic_waits_for_every_dependency_and_continues_the_longest() -> None:
    lines = [
        {"request_id": "a", "session_id": "x", "input_length": 1000, "output_length": 50, "timestamp": 500},
        {"request_id": "b", "session_id": "x", "input_length": 1200, "output_length": 10, "wait_for": ["a"],
         "delay": 100, "tool_wait_ms": 400},
        {"request_id": "c", "session_id": "x", "input_length": 1100, "output_length": 10, "wait_for": ["a"]},
        {"request_id": "d", "session_id": "x", "input_length": 1300, "output_length": 10, "wait_for": ["c", "b"]},
    ]
    trace = parse_sessions("\n".join(orjson.dumps(obj).decode() for obj in lines), "dyn.jsonl")
    assert trace is not None and len(trace.sessions) == 1
    rounds = {r.key: r for r in trace.sessions[0].rounds}
    assert rounds["b"].parent == "a" and rounds["b"].new_input_tokens == 1200 - 1050
    assert rounds["b"].wait_s == pytest.approx(0.5)
    assert rounds["c"].new_input_tokens == 50  # branches of one parent
    assert rounds["d"].wait_for == ("c", "b") and rounds["d"].parent == "b"  # b's input is the longest
    assert rounds["d"].new_input_tokens == 1300 - 1210


def test_other_formats_are_not_sessions_and_cycles_are_refused() -> None:
    assert parse_sessions('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n', "m") is None
    assert parse_sessions("TIMESTAMP,ContextTokens,GeneratedTokens\n", "azure.csv") is None
    cyclic = [{"request_id": "a", "session_id": "x", "input_length": 1, "output_length": 1, "wait_for": ["b"]},
              {"request_id": "b", "session_id": "x", "input_length": 1, "output_length": 1, "wait_for": ["a"]}]
    with pytest.raises(SessionFormatError, match="cycle"):
        parse_sessions("\n".join(orjson.dumps(o).decode() for o in cyclic), "cyc")
    with pytest.raises(SessionFormatError, match="unknown parameter"):
        load_sessions("synthetic:agent:loop=closed,bogus=1")


def test_copies_of_a_session_trace_are_sessions_of_their_own(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text(CSV)
    trace = load_sessions(f"{path}?copies=3,stagger_s=0.5")
    assert len(trace.sessions) == 6 and trace.rounds == 12
    assert [(s.id, s.arrival_s) for s in trace.sessions][:4] == [("s1~0", 0.0), ("s1~1", 0.5), ("s1~2", 1.0),
                                                                 ("s0~0", 2.0)]
    keys = [r.key for s in trace.sessions for r in s.rounds]
    assert len(set(keys)) == len(keys)
    for session in trace.sessions:  # each copy a chain of its own rounds, as the original
        first, second = session.rounds
        copy = session.id.partition("~")[2]
        assert first.session_id == second.session_id == session.id and first.key.endswith("~" + copy)
        assert second.parent == first.key and second.wait_for == (first.key,)
    original = parse_sessions(CSV, "t.csv")
    assert original is not None and load_sessions(f"{path}?copies=1") == original
    assert is_session_spec(f"{path}?copies=2")
    for bad in ("copies=0", "copies=two", "stagger=1"):
        with pytest.raises(SessionFormatError):
            load_sessions(f"{path}?{bad}")


@needs_shared(TRACELAB)
def test_the_shared_tracelab_files_load() -> None:
    multi = load_sessions(str(TRACELAB / "multi_session_example.csv"))
    assert len(multi.sessions) == 3 and multi.rounds == sum(len(s.rounds) for s in multi.sessions)
    rounds = load_sessions(str(TRACELAB / "claude_session_round_trace.jsonl"))
    assert len(rounds.sessions) == 2 and rounds.rounds == 19  # a Claude and a Codex session
    first = rounds.sessions[0].rounds[0]
    assert first.new_input_tokens == 27217 + 5055  # prefix_tokens + newly_append_tokens
    long = load_sessions(str(TRACELAB / "session_workload_example.csv"))
    assert len(long.sessions) == 1 and long.rounds > 10


def test_synthetic_agent_sessions_share_system_prompts_by_agent_type() -> None:
    trace = load_sessions("synthetic:agent:loop=closed,sessions=20,seed=3,agent_types=2")
    assert trace == agent_sessions(sessions="20", seed="3", agent_types="2")
    assert len(trace.sessions) == 20
    systems = {s.rounds[0].system for s in trace.sessions}
    assert 1 <= len(systems) <= 2 and all(r.system is None for s in trace.sessions for r in s.rounds[1:])


def test_synthetic_agents_fan_out_parallel_subagents_that_share_the_system_prompt() -> None:
    spec = "synthetic:agent:loop=closed,sessions=8,seed=5,steps=4,subagents=3,subagent_steps=2"
    trace = load_sessions(spec)
    plain = load_sessions(spec + ",lineage=0")
    fanned = [s for s in trace.sessions if any(r.agent for r in s.rounds)]
    assert fanned and all(len({r.agent for r in s.rounds if r.agent}) == 3 for s in fanned)
    for session in fanned:
        by_key = {r.key: r for r in session.rounds}
        firsts = [r for r in session.rounds if r.agent and r.index == 0]
        assert {r.system for r in firsts} == {session.rounds[0].system}  # the root's system prompt and tools
        assert all(r.parent is None and r.names_parent and len(r.wait_for) == 1 for r in firsts)
        spawn = by_key[firsts[0].wait_for[0]]
        assert spawn.agent is None and all(r.wait_for == firsts[0].wait_for for r in firsts)
        lasts = {max((r for r in session.rounds if r.agent == a), key=lambda r: r.index).key for a in ("sub0", "sub1",
                                                                                                          "sub2")}
        join = next(r for r in session.rounds if r.agent is None and r.index == spawn.index + 1)
        assert lasts <= set(join.wait_for) and join.parent == spawn.key
        assert firsts[0].agent_session == f"{session.id}/sub0"
    assert [[dataclasses.replace(r, names_parent=r.agent is not None) for r in s.rounds] for s in plain.sessions] == \
        [list(s.rounds) for s in trace.sessions]  # lineage=0: the same workload, no parent named
    assert load_sessions("synthetic:agent:loop=closed,sessions=8,seed=5,steps=4") == agent_sessions(
        sessions="8", seed="5", steps="4")


def test_subagents_are_sessions_of_their_own_naming_their_parent_and_the_join_waits_for_all() -> None:
    trace = load_sessions("synthetic:agent:loop=closed,sessions=3,seed=5,steps=4,subagents=2,subagent_steps=1,"
                          "tool_latency_s=0.001")
    echo = _Echo(delay=0.005)
    result = asyncio.run(replay_sessions(trace, _texts, echo, SessionReplayConfig(concurrency=3, progress=False)))
    assert all(r.ok for r in result.records)
    sent = {turns[-1].text: (when, sid, parent)
            for (when, sid, turns), parent in zip(echo.sent, echo.parents, strict=True)}
    for session in trace.sessions:
        for r in session.rounds:
            when, sid, parent = sent[f"input-{r.key}"]
            assert sid == r.agent_session and parent == (session.id if r.agent else None)
            for key in r.wait_for:
                assert sent[f"input-{key}"][0] < when


class _Echo:
    """A conversant that answers `answer-<n>` after `delay` s and records what it was sent."""

    def __init__(self, delay: float = 0.01, fail: set[int] | None = None):
        self.delay = delay
        self.fail = fail or set()
        self.sent: list[tuple[float, str | None, tuple[Turn, ...]]] = []
        self.parents: list[str | None] = []
        self.live = 0
        self.most_live = 0

    async def converse(self, turns: Sequence[Turn], max_tokens: int, record: RequestRecord,
                       session_id: str | None = None, parent_session_id: str | None = None,
                       tool_choice: str | None = None) -> Turn:
        self.sent.append((time.perf_counter(), session_id, tuple(turns)))
        self.parents.append(parent_session_id)
        n = len(self.sent)
        self.live += 1
        self.most_live = max(self.most_live, self.live)
        await asyncio.sleep(self.delay)
        self.live -= 1
        if n in self.fail:
            record.status, record.error = "error", RecordError.HTTP_5XX
            return Turn("assistant", "")
        record.status, record.prompt_tokens, record.output_tokens = "ok", 10 * len(turns), 3
        record.cached_tokens = 0
        return Turn("assistant", f"answer-{n}")


def _texts(r: Round, index: int) -> tuple[Turn, ...]:
    return (Turn("user", f"input-{r.key}"),)


def test_a_round_is_sent_after_its_parents_answer_plus_the_wait_with_that_answer() -> None:
    trace = parse_sessions("session_id,round_idx,prefix_len,input_len,output_len,tool_wait_after_ms\n"
                           "a,0,0,5,1,200\na,1,0,5,1,0\na,2,0,5,1,0\n", "x.csv")
    assert trace is not None
    echo = _Echo(delay=0.02)
    result = asyncio.run(replay_sessions(trace, _texts, echo, SessionReplayConfig(concurrency=1, progress=False)))
    (t0, sid, turns0), (t1, _, turns1), (_, _, turns2) = echo.sent
    assert sid == "a" and turns0 == (Turn("user", "input-a/0"),)
    assert turns1 == (Turn("user", "input-a/0"), Turn("assistant", "answer-1"), Turn("user", "input-a/1"))
    assert turns2[:3] == turns1 and turns2[3:] == (Turn("assistant", "answer-2"), Turn("user", "input-a/2"))
    assert t1 - t0 >= 0.02 + 0.2  # the parent's answer, then the tool wait
    assert [r.round_idx for r in result.records] == [0, 1, 2]
    assert result.records[1].planned_cached_tokens == 10 + 3  # the parent's prompt and answer
    (timing,) = result.sessions
    assert timing.makespan_s >= 0.26 and timing.service_s == pytest.approx(timing.makespan_s - 0.2, abs=1e-6)


class _Caller(_Echo):
    """Calls the tool when told to (`tool_choice` required), answers text otherwise."""

    def __init__(self) -> None:
        super().__init__()
        self.choices: list[str | None] = []

    async def converse(self, turns: Sequence[Turn], max_tokens: int, record: RequestRecord,
                       session_id: str | None = None, parent_session_id: str | None = None,
                       tool_choice: str | None = None) -> Turn:
        self.choices.append(tool_choice)
        answer = await super().converse(turns, max_tokens, record, session_id, parent_session_id)
        if tool_choice != "required":
            return answer
        return Turn("assistant", "", (ToolCall(f"call-{len(self.sent)}", "run", '{"command": "ls"}'),))


def test_with_tool_calls_a_continued_round_calls_and_its_follower_sends_the_result() -> None:
    trace = parse_sessions("session_id,round_idx,prefix_len,input_len,output_len,tool_wait_after_ms\n"
                           "a,0,0,5,1,0\na,1,0,5,1,0\na,2,0,5,1,0\n", "x.csv")
    assert trace is not None
    caller = _Caller()
    asyncio.run(replay_sessions(trace, _texts, caller,
                                SessionReplayConfig(concurrency=1, progress=False, tool_calls=True)))
    assert caller.choices == ["required", "required", "auto"]  # no round continues the last: the model decides
    (_, _, turns0), (_, _, turns1), (_, _, turns2) = caller.sent
    call1 = Turn("assistant", "", (ToolCall("call-1", "run", '{"command": "ls"}'),))
    assert turns1 == (*turns0, call1, Turn("tool", "input-a/1", tool_call_id="call-1"))
    call2 = Turn("assistant", "", (ToolCall("call-2", "run", '{"command": "ls"}'),))
    assert turns2 == (*turns1, call2, Turn("tool", "input-a/2", tool_call_id="call-2"))
    # Without tool calls nothing is offered and the input stays a user turn.
    caller = _Caller()
    asyncio.run(replay_sessions(trace, _texts, caller, SessionReplayConfig(concurrency=1, progress=False)))
    assert caller.choices == [None, None, None] and caller.sent[1][2][-1] == Turn("user", "input-a/1")


def test_a_failed_round_stops_its_followers_and_live_sessions_are_bounded() -> None:
    trace = load_sessions("synthetic:agent:loop=closed,sessions=6,seed=1,steps=3,tool_latency_s=0.001")
    echo = _Echo(fail={1})
    result = asyncio.run(replay_sessions(trace, _texts, echo, SessionReplayConfig(concurrency=2, progress=False)))
    assert echo.most_live <= 2
    assert len(result.records) == trace.rounds
    first_session = [r for r in result.records if r.session_id == trace.sessions[0].id]
    assert first_session[0].error == RecordError.HTTP_5XX
    assert all(r.error == RecordError.DEPENDENCY for r in first_session[1:])
    assert sum(r.ok for r in result.records) == trace.rounds - len(first_session)
    assert [r.index for r in result.records] == list(range(trace.rounds))


def test_session_figures() -> None:
    def rec(round_idx: int, prompt: int, cached: int, planned: int | None, ttft: float) -> RequestRecord:
        return RequestRecord(index=0, arrival_s=0, ttft_s=ttft, prompt_tokens=prompt, cached_tokens=cached,
                             output_tokens=1, round_idx=round_idx, session_id="s", planned_cached_tokens=planned)

    records = [rec(0, 1000, 0, None, 0.5), rec(1, 1200, 1024, 1100, 0.1), rec(2, 1500, 1152, 1300, 0.2),
               RequestRecord(index=3, arrival_s=0, status="error", error="http_5xx", round_idx=3)]
    figures = session_figures(records, [3.0, 5.0], [1.0, 2.0])
    assert figures["sessions"] == 2
    assert figures["follow_up_hit_rate"] == pytest.approx((1024 + 1152) / 2700)
    assert figures["planned_hit_rate"] == pytest.approx(2400 / 2700)
    assert figures["follow_up_vs_planned"] == pytest.approx(2176 / 2400)
    assert figures["session_makespan_s"]["max"] == 2.0 and figures["session_makespan_with_waits_s"]["max"] == 5.0
    assert set(figures["ttft_by_round"]) == {"0", "1", "2"}
    assert figures["ttft_by_round"]["1"]["ttft_s"]["p50"] == 0.1 and figures["ttft_by_round"]["0"]["hit_rate"] == 0


@pytest.mark.parametrize(("headers", "expected"), [
    ([(b"x-session-id", b"s1")], "s1"),
    ([(b"x-correlation-id", b"c1")], "c1"),
    ([(b"x-correlation-id", b"c1"), (b"x-session-id", b"s1")], "s1"),
    ([], None),
])
def test_the_gateway_reads_a_session_from_either_header(headers: list[tuple[bytes, bytes]],
                                                        expected: str | None) -> None:
    from starlette.requests import Request

    from deepinfer_gateway.core.session_identity import identity_from

    assert identity_from(Request({"type": "http", "headers": headers}).headers).session == expected
