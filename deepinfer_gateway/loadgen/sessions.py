"""Closed-loop session replay: each round is sent when the rounds it waits for have answered,
plus its wait; its prompt is its parent's conversation with the parent's ACTUAL answer.

- `concurrency` N: N live sessions; a new session starts as one finishes (trace order).
- no concurrency: each session starts at its arrival time / `speedup`.
Waits (tool run times) are divided by `speedup` too. A round whose parent failed is not sent
and is recorded as `dependency` (an agent stops when its model call fails).

Per session, `makespan_s` is its first send to its last answer, and `service_s` the same with
the waits on the path to its last answer removed: the time the serving stack cost the agent.

`tool_calls`: the rounds go out as tool calls and their results (turns.py): a round that
another round continues asks for a call, and the one continuing it sends its new input as
the call's result.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from deepinfer_gateway.loadgen.replay import Progress, ReplayResult
from deepinfer_gateway.loadgen.turns import Turn, results_of
from deepinfer_gateway.workload.sessions import Round, Session, SessionTiming, SessionTrace
from deepinfer_gateway.workload.types import RecordError, RequestRecord


class Conversant(Protocol):
    async def converse(self, turns: Sequence[Turn], max_tokens: int, record: RequestRecord,
                       session_id: str | None = None, parent_session_id: str | None = None,
                       tool_choice: str | None = None) -> Turn: ...


@dataclass(frozen=True)
class SessionReplayConfig:
    concurrency: int | None = None  # live sessions; None: sessions start at their arrival times
    speedup: float = 1.0  # divides arrival times and waits
    duration_s: float | None = None  # no round is sent after it
    drain_timeout_s: float = 60.0
    progress: bool = True
    tool_calls: bool = False  # rounds as tool calls and results (module doc)


@dataclass
class SessionReplayResult(ReplayResult):
    sessions: list[SessionTiming]


class _SessionRun:
    """One session's rounds, each a task that waits for its dependencies."""

    def __init__(self, session: Session, first_index: int, texts: Callable[[Round, int], Sequence[Turn]],
                 client: Conversant, config: SessionReplayConfig, start: float, deadline: float | None,
                 progress: Progress):
        self.session = session
        self.first_index = first_index
        self.texts, self.client, self.config = texts, client, config
        self.start, self.deadline, self.progress = start, deadline, progress
        self.finished = {r.key: asyncio.Event() for r in session.rounds}
        self.continued = {r.parent for r in session.rounds if r.parent is not None}
        self.conversation: dict[str, tuple[Turn, ...]] = {}
        self.records: dict[str, RequestRecord] = {}
        self.path_wait: dict[str, float] = {}
        self.ends: dict[str, float] = {}

    async def run(self) -> tuple[list[RequestRecord], SessionTiming | None]:
        began = time.perf_counter()
        await asyncio.gather(*(self._round(position, r) for position, r in enumerate(self.session.rounds)))
        records = [self.records[r.key] for r in self.session.rounds if r.key in self.records]
        if not self.ends:
            return records, None
        last = max(self.ends, key=self.ends.__getitem__)
        makespan = self.ends[last] - began
        timing = SessionTiming(self.session.id, len(records), makespan, makespan - self.path_wait[last])
        return records, timing

    async def _round(self, position: int, r: Round) -> None:
        try:
            for key in r.wait_for:
                await self.finished[key].wait()
            wait = r.wait_s / self.config.speedup if r.wait_for else 0.0
            self.path_wait[r.key] = wait + max((self.path_wait.get(k, 0.0) for k in r.wait_for), default=0.0)
            if wait > 0:
                await asyncio.sleep(wait)
            if self.deadline is not None and time.perf_counter() >= self.deadline:
                return
            await self._send(position, r)
        finally:
            self.finished[r.key].set()

    async def _send(self, position: int, r: Round) -> None:
        record = RequestRecord(index=self.first_index + position, arrival_s=time.perf_counter() - self.start,
                               expected_output_tokens=r.output_tokens, session_id=self.session.id,
                               round_idx=r.index)
        self.records[r.key] = record
        parent = self.records.get(r.parent) if r.parent else None
        if r.parent is not None and (parent is None or not parent.ok or r.parent not in self.conversation):
            record.status, record.error = "error", RecordError.DEPENDENCY
            record.detail = f"round {r.parent!r} it continues did not answer"
            self.progress.done(record)
            return
        if parent is not None and parent.prompt_tokens is not None:
            # The parent's prompt and answer come back as this prompt's start, except the
            # parent's reasoning, which chat templates drop: the shared prefix ends where it began.
            answered = 0 if parent.reasoning else parent.output_tokens or 0
            record.planned_cached_tokens = parent.prompt_tokens + answered
        history = self.conversation.get(r.parent, ()) if r.parent else ()
        new_input = self.texts(r, record.index)
        if history and history[-1].tool_calls:
            new_input = results_of(history[-1].tool_calls, new_input)
        turns = (*history, *new_input)
        # A subagent is a session of its own; it names the root agent's as its parent when the trace says so.
        parent_session = self.session.id if r.agent is not None and r.names_parent else None
        tool_choice = ("required" if r.key in self.continued else "auto") if self.config.tool_calls else None
        answer = await self.client.converse(turns, max(1, r.output_tokens), record, r.agent_session, parent_session,
                                            tool_choice)
        self.ends[r.key] = time.perf_counter()
        if record.ok:
            self.conversation[r.key] = (*turns, answer)
        self.progress.done(record)


async def replay_sessions(trace: SessionTrace, texts: Callable[[Round, int], Sequence[Turn]], client: Conversant,
                          config: SessionReplayConfig) -> SessionReplayResult:
    """`texts(round, record index)`: the turns a round appends (its system prompt, its new input)."""
    progress = Progress(trace.rounds, config.progress)
    synthesis_cpu = 0.0

    def timed_texts(r: Round, index: int) -> Sequence[Turn]:
        nonlocal synthesis_cpu
        t0 = time.process_time()
        turns = texts(r, index)
        synthesis_cpu += time.process_time() - t0
        return turns

    cpu0 = time.process_time()
    start = time.perf_counter()
    deadline = start + config.duration_s if config.duration_s else None
    records: list[RequestRecord] = []
    timings: list[SessionTiming] = []
    firsts: list[int] = []
    total = 0
    for session in trace.sessions:
        firsts.append(total)
        total += len(session.rounds)

    async def one(i: int) -> None:
        run = _SessionRun(trace.sessions[i], firsts[i], timed_texts, client, config, start, deadline, progress)
        got, timing = await run.run()
        records.extend(got)
        if timing is not None:
            timings.append(timing)

    async def arrivals() -> None:
        tasks = []
        for i, session in enumerate(trace.sessions):
            delay = start + session.arrival_s / config.speedup - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if deadline is not None and time.perf_counter() >= deadline:
                break
            tasks.append(asyncio.ensure_future(one(i)))
        await asyncio.gather(*tasks)

    async def live(n: int) -> None:
        queue = iter(range(len(trace.sessions)))

        async def user() -> None:
            for i in queue:
                if deadline is not None and time.perf_counter() >= deadline:
                    return
                await one(i)

        await asyncio.gather(*(user() for _ in range(n)))

    main = asyncio.ensure_future(live(config.concurrency) if config.concurrency else arrivals())
    try:
        budget = None if deadline is None else deadline - start + config.drain_timeout_s
        done, _ = await asyncio.wait({main}, timeout=budget)
        if not done:
            main.cancel()
            await asyncio.gather(main, return_exceptions=True)
        else:
            main.result()
    finally:
        progress.close()
    ends = [r.arrival_s + r.e2e_s for r in records if r.e2e_s is not None]
    wall = max(ends) if ends else time.perf_counter() - start
    records.sort(key=lambda r: r.index)
    timings.sort(key=lambda t: t.session_id)
    return SessionReplayResult(records, wall, time.process_time() - cpu0, synthesis_cpu, timings)
