"""End to end: closed-loop session replay through the real SDKs -> gateway -> sim workers."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from deepinfer_gateway.core.protocol import DEFAULT_MODEL
from deepinfer_gateway.loadgen.client import ClientConfig, ProtocolClient
from deepinfer_gateway.loadgen.run import session_texts
from deepinfer_gateway.loadgen.sessions import SessionReplayConfig, replay_sessions
from deepinfer_gateway.loadgen.turns import Turn
from deepinfer_gateway.process.cli import main as cli_main
from deepinfer_gateway.workload.sessions import load_sessions
from deepinfer_gateway.workload.synthesis import PromptSynthesizer
from deepinfer_gateway.workload.types import RequestRecord, read_records
from harness.launch import Gateway, SimCluster
from tests.shared_data import TRACELAB, needs_shared

MULTI = TRACELAB / "multi_session_example.csv"
KV_BLOCK = 128  # the sim workers' KV block (tokens)


@pytest.fixture(scope="module")
def agent_gateway(sim_cluster: SimCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """A gateway as an agent deployment runs it: sessions (the clients' X-Session-ID /
    X-Correlation-ID headers) kept on their worker."""
    roles = [spec.split(":") for spec in sim_cluster.specs]
    gw = Gateway(tmp_path_factory.mktemp("agent-gw"),
                 [(url, role, hw) for url, (role, hw) in zip(sim_cluster.urls, roles, strict=True)],
                 extra_toml="[router]\nsession_affinity = true")
    gw.wait_ready(len(roles))
    yield gw
    gw.stop()


class _Recording(ProtocolClient):
    """The real SDK client, keeping each round's turns and answer."""

    def __init__(self, config: ClientConfig):
        super().__init__(config)
        self.rounds: list[tuple[RequestRecord, tuple[Turn, ...], Turn, str | None]] = []

    async def converse(self, turns: Sequence[Turn], max_tokens: int, record: RequestRecord,
                       session_id: str | None = None, parent_session_id: str | None = None,
                       tool_choice: str | None = None) -> Turn:
        answer = await super().converse(turns, max_tokens, record, session_id, parent_session_id, tool_choice)
        self.rounds.append((record, tuple(turns), answer, tool_choice))
        return answer


@pytest.mark.parametrize("protocol", ["chat", "responses", "messages"])
def test_a_follow_up_round_carries_the_previous_answer_and_hits_the_cache(agent_gateway: Gateway,
                                                                         protocol: str) -> None:
    trace = load_sessions("synthetic:agent:loop=closed,sessions=2,seed=4,steps=3,tool_latency_s=0.05,"
                          "system_tokens=600,task_tokens=300,tool_result_tokens=200,call_tokens=400")

    async def run() -> _Recording:
        # deepseek-chat: without thinking, so the whole answer is part of the next prompt
        # (chat templates drop an earlier turn's reasoning).
        client = _Recording(ClientConfig(url=agent_gateway.url, model="deepseek-chat", protocol=protocol,
                                         api_key="test", ignore_eos=True))
        try:
            await replay_sessions(trace, session_texts(PromptSynthesizer.for_default_tokenizer()), client,
                                  SessionReplayConfig(concurrency=2, progress=False))
        finally:
            await client.aclose()
        return client

    client = asyncio.run(run())
    assert len(client.rounds) == trace.rounds and all(record.ok for record, *_ in client.rounds)
    by_key = {(record.session_id, record.round_idx): (record, turns, answer)
              for record, turns, answer, _ in client.rounds}
    follow_ups = 0
    for (session, index), (record, turns, _) in by_key.items():
        if not index:
            continue
        parent, parent_turns, parent_answer = by_key[(session, index - 1)]
        # The prompt is the parent's conversation, the parent's actual answer, then the new input.
        assert parent_answer.text and turns[:len(parent_turns)] == parent_turns
        assert turns[len(parent_turns)] == parent_answer
        assert record.planned_cached_tokens == parent.prompt_tokens + parent.output_tokens
        assert record.prompt_tokens > record.planned_cached_tokens
        # The engine served the parent's prompt AND its answer from its cache: the answer came
        # back token for token (a block of it that differed would end the cached prefix there).
        reusable = (record.planned_cached_tokens // KV_BLOCK) * KV_BLOCK
        assert not parent.reasoning
        assert record.cached_tokens >= reusable, (session, index, record.cached_tokens, reusable)
        assert reusable > parent.prompt_tokens  # so the answer's tokens are among those cached
        assert record.worker == parent.worker  # the session header kept it on its worker
        follow_ups += 1
    assert follow_ups == trace.rounds - len(trace.sessions)


@pytest.mark.parametrize(("protocol", "lean"), [("chat", False), ("chat", True), ("responses", False),
                                               ("messages", False)], ids=["chat", "chat-lean", "responses", "messages"])
def test_with_tool_calls_each_call_comes_back_as_the_next_prompt_and_stays_cached(agent_gateway: Gateway,
                                                                                  protocol: str, lean: bool) -> None:
    trace = load_sessions("synthetic:agent:loop=closed,sessions=2,seed=4,steps=3,tool_latency_s=0.05,"
                          "system_tokens=600,task_tokens=300,tool_result_tokens=200,call_tokens=400")

    async def run() -> _Recording:
        # The served name, whose default is thinking: the replay turns it off on every round.
        client = _Recording(ClientConfig(url=agent_gateway.url, model=DEFAULT_MODEL, protocol=protocol,
                                         api_key="test", ignore_eos=True, lean=lean))
        try:
            await replay_sessions(trace, session_texts(PromptSynthesizer.for_default_tokenizer()), client,
                                  SessionReplayConfig(concurrency=2, progress=False, tool_calls=True))
        finally:
            await client.aclose()
        return client

    client = asyncio.run(run())
    assert len(client.rounds) == trace.rounds and all(record.ok for record, *_ in client.rounds)
    by_key = {(record.session_id, record.round_idx): (record, turns, answer, choice)
              for record, turns, answer, choice in client.rounds}
    lengths = {session.id: len(session.rounds) for session in trace.sessions}
    for (session, index), (record, turns, answer, choice) in by_key.items():
        last = index == lengths[session] - 1
        assert choice == ("auto" if last else "required")
        if last and index:  # left to the model after a tool result: a text answer
            assert answer.text and not answer.tool_calls
        elif not last:  # the gateway parsed the sim's call of the offered tool out of the stream
            (call,) = answer.tool_calls
            assert call.name == "run" and call.id and "command" in json.loads(call.arguments)
            # as long as the trace's answer (min_tokens, the call's argument longer), and whole
            assert record.expected_output_tokens <= record.output_tokens <= record.expected_output_tokens + 32
        if not index:
            continue
        parent, parent_turns, parent_answer, _ = by_key[(session, index - 1)]
        # The parent's call, then its result carrying this round's new input.
        assert turns[:len(parent_turns)] == parent_turns and turns[len(parent_turns)] == parent_answer
        result = turns[len(parent_turns) + 1]
        assert result.role == "tool" and result.tool_call_id == parent_answer.tool_calls[0].id and result.text
        assert record.planned_cached_tokens == parent.prompt_tokens + parent.output_tokens
        # The template rendered the call again exactly as the model wrote it: the cached prefix
        # runs through the parent's answer.
        reusable = (record.planned_cached_tokens // KV_BLOCK) * KV_BLOCK
        assert record.cached_tokens >= reusable, (session, index, record.cached_tokens, reusable)
        assert record.worker == parent.worker


@needs_shared(MULTI)
def test_bench_cli_replays_a_tracelab_file_closed_loop(agent_gateway: Gateway, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sessions"
    rc = cli_main(["bench", "--url", agent_gateway.url, "--trace", str(MULTI), "--concurrency", "2",
                   "--speedup", "20", "--out", str(out), "--no-progress", "--ignore-eos"])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    trace = load_sessions(str(MULTI))
    assert summary["mode"] == "sessions" and summary["sessions"] == len(trace.sessions) == 3
    assert summary["completed"] == summary["requests"] == trace.rounds and summary["errors"] == {}
    assert 0 < summary["planned_hit_rate"] < 1 and summary["follow_up_hit_rate"] > 0
    assert summary["follow_up_vs_planned"] >= 0.8
    assert set(summary["ttft_by_round"]) == {str(i) for i in range(max(len(s.rounds) for s in trace.sessions))}
    assert summary["session_makespan_s"]["count"] == 3
    assert summary["session_makespan_s"]["max"] <= summary["session_makespan_with_waits_s"]["max"]
    records = read_records(out / "results.jsonl")
    assert {r.session_id for r in records} == {s.id for s in trace.sessions}
    assert (out / "by_round.png").exists()
