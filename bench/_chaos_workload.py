"""bench/chaos.py's load: multi-turn chat sessions as an open-loop hash-id trace.

A session starts every `session_interval_s`; its turn t is sent `t * turn_gap_s` after its
start whatever happened to turn t-1 (open loop). Each session has a system prompt of its
own, and turn t's prompt is turn t-1's plus a written answer and a new user message, so a
follow-up turn (t >= 1) can hit the cache only on the worker that served its session
before, and a first turn never hits: the follow-up hit rate measures prefix-aware routing
alone. Segment lengths are whole blocks, so a prompt's blocks are exactly the blocks of the
previous turn's prompt followed by new ones (synthesis.py turns block ids into text).
"""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer_gateway.workload.synthetic import BlockChain
from deepinfer_gateway.workload.types import Trace, TraceRequest


@dataclass(frozen=True)
class SessionLoad:
    duration_s: float  # no turn is scheduled at or after it
    session_interval_s: float = 1.5
    turns: int = 6
    turn_gap_s: float = 2.5
    system_tokens: int = 1024
    user_tokens: int = 128
    answer_tokens: int = 128
    max_tokens: int = 8
    block_size: int = 128


@dataclass(frozen=True)
class SessionTrace:
    trace: Trace
    turn_of: tuple[int, ...]  # request index -> its turn in its session (0: first)
    previous: tuple[int | None, ...]  # request index -> the index of its session's turn before, None for turn 0

    def follow_up(self, index: int) -> bool:
        return self.turn_of[index] > 0


def session_trace(load: SessionLoad) -> SessionTrace:
    for name in ("system_tokens", "user_tokens", "answer_tokens"):
        if getattr(load, name) % load.block_size:
            raise ValueError(f"{name} must be a multiple of block_size ({load.block_size})")
    chain = BlockChain(load.block_size)
    rows: list[tuple[float, int, tuple[int, ...], int, int]] = []  # (arrival, length, block ids, session, turn)
    session = 0
    while (start := session * load.session_interval_s) < load.duration_s:
        segments = [(f"system {session}", load.system_tokens)]
        for turn in range(load.turns):
            arrival = start + turn * load.turn_gap_s
            if arrival >= load.duration_s:
                break
            segments.append((f"user {session}.{turn}", load.user_tokens))
            rows.append((arrival, sum(n for _, n in segments), chain.ids(segments), session, turn))
            segments.append((f"answer {session}.{turn}", load.answer_tokens))
        session += 1
    rows.sort(key=lambda row: row[0])
    index_of = {(row[3], row[4]): i for i, row in enumerate(rows)}
    requests = tuple(TraceRequest(i, arrival, length, load.max_tokens, ids)
                     for i, (arrival, length, ids, _, _) in enumerate(rows))
    return SessionTrace(Trace("chaos-sessions", requests, load.block_size), tuple(row[4] for row in rows),
                        tuple(index_of.get((row[3], row[4] - 1)) if row[4] else None for row in rows))
