"""Closed-loop sessions in virtual time: `loadgen/sessions.py`'s semantics on the simulator.

A round arrives when every round it waits for has ended (finished or failed, at that
virtual time) plus its wait / speedup; a round whose parent failed is not sent and is
recorded as `dependency`, as the live replay does. Sessions start at their arrival time /
speedup, or with `concurrency` N, N at a time, the next one when one ends.

Prompt ids, in the layout `tokens.PromptTokens` gives trace requests:
- a first round: the template header, the session's system prompt when it has one (the same
  ids for every session of that agent type), its new input (ids unique to the round), the
  template trailer;
- a follow-up: its parent's prompt ids, the ids the sim engine produced as the parent's
  answer, `TURN_TOKENS` ids closing the assistant turn and opening the next user turn, the
  new input, the trailer. The chat template is not rendered here: `TURN_TOKENS` stands for
  DeepSeek's end-of-sentence and `<｜User｜>` tokens, and the parent's trailer stays in the
  prefix (a rendered history may re-render it differently; a live engine would then miss
  those few tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from deepinfer_gateway.core.session_identity import SessionIdentity
from deepinfer_gateway.simulate.gateway import RequestState
from deepinfer_gateway.simulate.simulator import Simulator
from deepinfer_gateway.simulate.tokens import VOCAB, PromptTokens
from deepinfer_gateway.workload.sessions import Round, Session, SessionTiming, SessionTrace
from deepinfer_gateway.workload.types import RecordError, RequestRecord, TraceRequest

TURN_TOKENS = 2  # end of the assistant turn, start of the next user turn
_TURN = [VOCAB + 48 + i for i in range(TURN_TOKENS)]
_ROUND_STRIDE = 1 << 20  # private blocks per round
_SYSTEM_STRIDE = 1 << 16  # blocks per agent type's system prompt


def round_input_ids(prompts: PromptTokens, number: int, tokens: int) -> list[int]:
    """`tokens` ids unique to round `number` (odd block numbers: never a trace's shared block)."""
    count = -(-tokens // prompts.block_size)
    return prompts.blocks([2 * (number * _ROUND_STRIDE + b) + 1 for b in range(count)], tokens)


def system_ids(prompts: PromptTokens, kind: int, tokens: int) -> list[int]:
    """The system prompt of agent type `kind`: the same ids in every session of that type."""
    count = -(-tokens // prompts.block_size)
    return prompts.blocks([2 * (kind * _SYSTEM_STRIDE + b) for b in range(count)], tokens)


@dataclass
class _Live:
    """One started session: what its rounds wait for and what ended rounds left behind."""

    session: Session
    start: float
    first_index: int
    waiting: dict[str, int]  # round key -> dependencies not yet ended
    children: dict[str, list[Round]]  # round key -> rounds waiting for it
    unresolved: int
    ends: dict[str, float] = field(default_factory=dict)  # key -> virtual end (sent rounds)
    path_wait: dict[str, float] = field(default_factory=dict)
    ready_at: dict[str, float] = field(default_factory=dict)  # the latest dependency end so far
    prompt: dict[str, list[int]] = field(default_factory=dict)  # ended ok: prompt ids + answer ids
    records: dict[str, RequestRecord] = field(default_factory=dict)


class SessionDriver:
    """Feeds a `SessionTrace`'s rounds to a `Simulator` as their dependencies end."""

    def __init__(self, sim: Simulator, trace: SessionTrace, concurrency: int | None = None) -> None:
        if concurrency is not None and concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        self.sim, self.trace, self.concurrency = sim, trace, concurrency
        self.prompts = sim.prompts
        self.records: list[RequestRecord] = []
        self.timings: list[SessionTiming] = []
        self._firsts: list[int] = []
        total = 0
        for session in trace.sessions:
            self._firsts.append(total)
            total += len(session.rounds)
        self._next = 0  # the next session to start (concurrency mode)
        self._rounds: dict[str, tuple[_Live, Round]] = {}  # request id -> its session and round
        sim.gateway.on_end = self._ended

    def run(self) -> list[RequestRecord]:
        speedup = self.sim.speedup
        if self.concurrency:
            for _ in range(min(self.concurrency, len(self.trace.sessions))):
                self._start_next(0.0)
        else:
            for i, session in enumerate(self.trace.sessions):
                self._start(i, session.arrival_s / speedup)
        self.sim.run_events(self.trace.rounds)
        return sorted(self.records, key=lambda r: r.index)

    def _start_next(self, t: float) -> None:
        if self._next < len(self.trace.sessions):
            self._next += 1
            self._start(self._next - 1, t)

    def _start(self, i: int, t: float) -> None:
        session = self.trace.sessions[i]
        children: dict[str, list[Round]] = {}
        for r in session.rounds:
            for key in r.wait_for:
                children.setdefault(key, []).append(r)
        live = _Live(session, t, self._firsts[i], {r.key: len(r.wait_for) for r in session.rounds}, children,
                     len(session.rounds))
        for r in session.rounds:
            if not r.wait_for:
                live.path_wait[r.key] = 0.0
                self._release(live, r, t)

    def _release(self, live: _Live, r: Round, t: float) -> None:
        """Round `r`'s dependencies have all ended by t (its wait already added)."""
        position = live.session.rounds.index(r)
        record = RequestRecord(index=live.first_index + position, arrival_s=t, send_lag_s=0.0,
                               expected_output_tokens=r.output_tokens, session_id=live.session.id, round_idx=r.index)
        live.records[r.key] = record
        self.records.append(record)
        if r.parent is not None:
            context = live.prompt.get(r.parent)
            parent = live.records.get(r.parent)
            if context is None or parent is None:
                record.status, record.error = "error", RecordError.DEPENDENCY
                record.detail = f"round {r.parent!r} it continues did not answer"
                self._resolve(live, r, t)
                return
            record.planned_cached_tokens = len(context)
            tokens = context + _TURN + round_input_ids(self.prompts, record.index, r.new_input_tokens)
        else:
            tokens = list(self.prompts.header)
            if r.system is not None:
                tokens += system_ids(self.prompts, *r.system)
            tokens += round_input_ids(self.prompts, record.index, r.new_input_tokens)
        tokens += self.prompts.trailer
        template = len(self.prompts.header) + len(self.prompts.trailer)
        record.expected_input_tokens = len(tokens) - template
        request = TraceRequest(record.index, t, len(tokens) - template, max(1, r.output_tokens))
        self._rounds[str(record.index)] = (live, r)
        self.sim.gateway.session_of[record.index] = SessionIdentity(r.agent_session,
                                                                    r.session_id if r.names_parent else None)
        self.sim.arrive_at(t, request, record, tokens)

    def _ended(self, req: RequestState) -> None:
        """A round finished or failed (`SimGateway.on_end`), at the simulator's now."""
        found = self._rounds.pop(str(req.trace.index), None)
        if found is None:
            return
        live, r = found
        t = self.sim.now
        live.ends[r.key] = t
        if req.record.ok:
            live.prompt[r.key] = list(req.tokens) + req.output[: req.emitted]
        self._resolve(live, r, t)

    def _resolve(self, live: _Live, r: Round, t: float) -> None:
        """Round `r` ended (or was skipped) at t: release the rounds that waited only for it."""
        live.unresolved -= 1
        last = live.unresolved == 0  # (a skipped descendant resolved below cannot be the last one then)
        for child in live.children.get(r.key, ()):
            live.ready_at[child.key] = max(live.ready_at.get(child.key, t), t)
            live.path_wait[child.key] = max(live.path_wait.get(child.key, 0.0), live.path_wait.get(r.key, 0.0))
            live.waiting[child.key] -= 1
            if live.waiting[child.key] == 0:
                wait = child.wait_s / self.sim.speedup
                live.path_wait[child.key] += wait
                self._release(live, child, live.ready_at[child.key] + wait)
        if all(live.waiting[c.key] == 0 for c in live.children.get(r.key, ())):
            live.prompt.pop(r.key, None)  # every round continuing it has taken its copy
        if last:
            self._finish(live, t)

    def _finish(self, live: _Live, t: float) -> None:
        if live.ends:
            last = max(live.ends, key=live.ends.__getitem__)
            makespan = live.ends[last] - live.start
            self.timings.append(SessionTiming(live.session.id, len(live.records), makespan,
                                              makespan - live.path_wait[last]))
        live.prompt.clear()
        if self.concurrency:
            self._start_next(t)
