"""Closed-loop agent sessions: rounds that wait for earlier rounds' answers, and their loaders.

A session is a conversation that grows round by round. A round is released when every round
it waits for has finished, plus its wait (the tool's run time, a user's think time); its
prompt is its parent's whole conversation (the parent's prompt and the parent's ACTUAL
answer, as the assistant turn) plus `new_input_tokens` of new input. A round without a parent
starts a conversation. Only the shape lives here; `loadgen/sessions.py` sends the rounds.

Formats, told apart by content (`load_sessions`):
- TraceLab session CSV: `session_id, arrival_time (ms, optional), round_idx, prefix_len,
  input_len, output_len, tool_wait_after_ms`; rounds of a session form a chain. A first
  round's `prefix_len` is context the session starts with (sent as part of its input).
- TraceLab per-round JSONL (`prefix_tokens`, `newly_append_tokens`, `output_tokens`,
  `tools[].tool_wall_latency_ms`): one chain per `session_id`; the wait after a round is the
  sum of its tools' wall latencies.
- Dynamo `agentic_mooncake` JSONL (`request_id`, `session_id`, `input_length`,
  `output_length`, `wait_for`, `delay`, `tool_wait_ms`, `timestamp`): a round waits for all of
  `wait_for`; its parent is the `wait_for` round of the same session with the longest input
  (the conversation it continues); its new input is what its `input_length` adds to the
  parent's context (input + output), at least one token. `branches` (a parent's fan-out) is
  implied by several rounds naming the same `wait_for`.
- `FILE?copies=N[,stagger_s=S]`: a session file's sessions N times over (`SessionTrace.copies`).
- `synthetic:agent:loop=closed,...`: `agent_sessions`, the synthetic agent as sessions, with
  `subagents=K`: at one step the agent fans out K parallel subagents (each its own conversation
  starting with the agent's system prompt and tools, `subagent_steps` rounds on average), and
  its next round waits for all of them (their reports as its new input). `lineage=0`: the
  subagents' requests do not name their parent (the same workload without lineage).
"""

from __future__ import annotations

import csv
import dataclasses
import io
import math
import random
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from deepinfer_gateway.workload.types import key_values


class SessionFormatError(ValueError):
    """A session trace this module cannot read; the message names the line or field."""


@dataclass(frozen=True, slots=True)
class Round:
    """One request of a session. `key` is unique in its trace; times in trace seconds."""

    key: str
    session_id: str
    index: int  # position in its session (0: the first round)
    new_input_tokens: int  # appended by this round (a first round: its whole prompt content)
    output_tokens: int
    parent: str | None = None  # the round whose conversation this one continues
    wait_for: tuple[str, ...] = ()  # rounds that must finish first (the parent included)
    wait_s: float = 0.0  # after the last of `wait_for` finished (tool run time, think time)
    system: tuple[int, int] | None = None  # a first round's shared system prompt: (its id, tokens)
    agent: str | None = None  # a subagent's id in its session (None: the root agent); its own conversation
    names_parent: bool = False  # a subagent's requests name the root agent's session as their parent

    @property
    def agent_session(self) -> str:
        """The session its requests name: the root agent's, or `<session>/<agent>` for a subagent."""
        return self.session_id if self.agent is None else f"{self.session_id}/{self.agent}"


@dataclass(frozen=True, slots=True)
class Session:
    id: str
    arrival_s: float  # when its first rounds are released, on the trace clock (rebased to 0)
    rounds: tuple[Round, ...]  # in an order where every round follows those it waits for


@dataclass(frozen=True, slots=True)
class SessionTiming:
    """One replayed session's times (bench or simulate): first send to last answer, and the same
    without the waits on the path to that answer (what the serving stack cost the agent)."""

    session_id: str
    rounds: int
    makespan_s: float
    service_s: float


@dataclass(frozen=True, slots=True)
class SessionTrace:
    name: str
    sessions: tuple[Session, ...]  # by arrival

    @property
    def rounds(self) -> int:
        return sum(len(s.rounds) for s in self.sessions)

    def head(self, max_rounds: int | None) -> SessionTrace:
        """Whole sessions, in arrival order, up to `max_rounds` rounds in all (at least one session)."""
        if max_rounds is None:
            return self
        kept: list[Session] = []
        total = 0
        for session in self.sessions:
            if kept and total + len(session.rounds) > max_rounds:
                break
            kept.append(session)
            total += len(session.rounds)
        return SessionTrace(self.name, tuple(kept))

    def copies(self, count: int, stagger_s: float = 0.0) -> SessionTrace:
        """Every session `count` times, copy k's ids and round keys suffixed `~k` and its arrival
        `k x stagger_s` later (copies of one session in a row): many agents working in the shape
        of a few recorded sessions. Every copy's texts are its own (a replay draws them per
        round), so copies share no prefix."""
        if count < 1 or stagger_s < 0:
            raise SessionFormatError(f"copies must be >= 1 and stagger_s >= 0, not {count} and {stagger_s}")
        if count == 1:
            return self

        def renamed(r: Round, k: int) -> Round:
            return dataclasses.replace(r, key=f"{r.key}~{k}", session_id=f"{r.session_id}~{k}",
                                       parent=None if r.parent is None else f"{r.parent}~{k}",
                                       wait_for=tuple(f"{w}~{k}" for w in r.wait_for))

        sessions = (Session(f"{s.id}~{k}", s.arrival_s + k * stagger_s, tuple(renamed(r, k) for r in s.rounds))
                    for s in self.sessions for k in range(count))
        return SessionTrace(f"{self.name} x{count}", tuple(sorted(sessions, key=lambda s: s.arrival_s)))


# --- building ---------------------------------------------------------------------------------

def _ordered(rounds: list[Round]) -> tuple[Round, ...]:
    """Rounds in dependency order (stable); refuses a wait on an unknown or later-cyclic round."""
    by_key = {r.key: r for r in rounds}
    for r in rounds:
        missing = [k for k in r.wait_for if k not in by_key]
        if missing:
            raise SessionFormatError(f"round {r.key!r} waits for unknown round(s) {missing}")
    done: set[str] = set()
    out: list[Round] = []
    pending = list(rounds)
    while pending:
        ready = [r for r in pending if all(k in done for k in r.wait_for)]
        if not ready:
            raise SessionFormatError(f"rounds {[r.key for r in pending][:5]} wait for each other (a cycle)")
        for r in ready:
            done.add(r.key)
            out.append(r)
        pending = [r for r in pending if r.key not in done]
    return tuple(out)


def _trace(name: str, sessions: dict[str, tuple[float, list[Round]]]) -> SessionTrace:
    if not sessions:
        raise SessionFormatError(f"{name}: no rounds")
    t0 = min(arrival for arrival, _ in sessions.values())
    built = [Session(sid, arrival - t0, _ordered(rounds)) for sid, (arrival, rounds) in sessions.items()]
    built.sort(key=lambda s: s.arrival_s)  # stable: equal arrivals keep file order
    return SessionTrace(name, tuple(built))


def _chain(session_id: str, rows: Iterable[tuple[int, int, int, float]], first_context: int = 0) -> list[Round]:
    """Rounds of one chain from (round index, new input, output, wait after) rows, by index."""
    out: list[Round] = []
    wait_after = 0.0
    for position, (_, new_input, output, wait) in enumerate(sorted(rows, key=lambda row: row[0])):
        parent = out[-1].key if out else None
        extra = first_context if position == 0 else 0
        out.append(Round(f"{session_id}/{position}", session_id, position, max(1, new_input + extra),
                         max(1, output), parent, (parent,) if parent else (), wait_after))
        wait_after = wait
    return out


# --- TraceLab CSV -----------------------------------------------------------------------------

def _tracelab_csv(text: str, name: str) -> SessionTrace:
    reader = csv.DictReader(io.StringIO(text))
    rows: dict[str, list[tuple[int, int, int, float]]] = {}
    arrival: dict[str, float] = {}
    first_prefix: dict[str, tuple[int, int]] = {}  # session -> (lowest round index, its prefix_len)
    for lineno, row in enumerate(reader, 2):
        try:
            sid = row["session_id"].strip()
            index = int(row["round_idx"])
            record = (index, int(row["input_len"]), int(row["output_len"]),
                      float(row.get("tool_wait_after_ms") or 0) / 1000.0)
            prefix = int(row.get("prefix_len") or 0)
            start = float(row.get("arrival_time") or 0) / 1000.0
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise SessionFormatError(f"{name}:{lineno}: not a TraceLab session row ({exc})") from None
        rows.setdefault(sid, []).append(record)
        arrival[sid] = min(arrival.get(sid, start), start)
        if sid not in first_prefix or index < first_prefix[sid][0]:
            first_prefix[sid] = (index, prefix)
    return _trace(name, {sid: (arrival[sid], _chain(sid, r, first_prefix[sid][1])) for sid, r in rows.items()})


# --- TraceLab per-round JSONL -----------------------------------------------------------------

def _tracelab_rounds(objs: list[dict[str, Any]], name: str) -> SessionTrace:
    rows: dict[str, list[tuple[int, int, int, float]]] = {}
    first_prefix: dict[str, tuple[int, int]] = {}
    for lineno, obj in enumerate(objs, 1):
        try:
            sid = str(obj["session_id"])
            index = int(obj["round_index"])
            tools = obj.get("tools") or []
            wait = sum(float(t.get("tool_wall_latency_ms") or 0) for t in tools) / 1000.0
            rows.setdefault(sid, []).append(
                (index, int(obj["newly_append_tokens"]), int(obj["output_tokens"] or 0), wait))
            prefix = int(obj.get("prefix_tokens") or 0)
        except (KeyError, TypeError, ValueError) as exc:
            raise SessionFormatError(f"{name}:{lineno}: not a TraceLab round ({exc})") from None
        if sid not in first_prefix or index < first_prefix[sid][0]:
            first_prefix[sid] = (index, prefix)
    return _trace(name, {sid: (0.0, _chain(sid, r, first_prefix[sid][1])) for sid, r in rows.items()})


# --- Dynamo agentic_mooncake JSONL ------------------------------------------------------------

def _dynamo(objs: list[dict[str, Any]], name: str) -> SessionTrace:
    parsed: list[tuple[str, str, int, int, tuple[str, ...], float, float]] = []
    for lineno, obj in enumerate(objs, 1):
        try:
            parsed.append((str(obj["request_id"]), str(obj.get("session_id", obj["request_id"])),
                           int(obj["input_length"]), int(obj["output_length"]),
                           tuple(str(k) for k in obj.get("wait_for") or ()),
                           (float(obj.get("delay") or 0) + float(obj.get("tool_wait_ms") or 0)) / 1000.0,
                           float(obj.get("timestamp") or 0) / 1000.0))
        except (KeyError, TypeError, ValueError) as exc:
            raise SessionFormatError(f"{name}:{lineno}: not an agentic_mooncake request ({exc})") from None
    info = {p[0]: p for p in parsed}
    if len(info) != len(parsed):
        raise SessionFormatError(f"{name}: repeated request_id")
    sessions: dict[str, tuple[float, list[Round]]] = {}
    counters: dict[str, int] = {}
    for key, sid, inp, out, wait_for, wait, stamp in parsed:
        same = [info[k] for k in wait_for if k in info and info[k][1] == sid]
        parent = max(same, key=lambda p: p[2]) if same else None
        new_input = inp - (parent[2] + parent[3]) if parent else inp
        position = counters.get(sid, 0)
        counters[sid] = position + 1
        entry = sessions.setdefault(sid, (stamp, []))
        if not wait_for:
            sessions[sid] = (min(entry[0], stamp), entry[1])
        entry[1].append(Round(key, sid, position, max(1, new_input), max(1, out),
                              parent[0] if parent else None, wait_for, wait))
    return _trace(name, sessions)


# --- synthetic --------------------------------------------------------------------------------

def _lognormal(rng: random.Random, mean: float, sigma: float) -> int:
    mu = math.log(mean) - sigma * sigma / 2
    return max(1, int(rng.lognormvariate(mu, sigma)))


def agent_sessions(sessions: str = "48", seed: str = "0", rate: str = "0.5", agent_types: str = "4",
                   zipf: str = "1.0", system_tokens: str = "6000", task_tokens: str = "500",
                   tool_result_tokens: str = "700", call_tokens: str = "80", steps: str = "12",
                   tool_latency_s: str = "1.5", subagents: str = "0", subagent_steps: str = "3",
                   lineage: str = "1") -> SessionTrace:
    """The synthetic agent (`synthetic.agent`) as closed-loop sessions: a tool-spec system prompt
    per agent type (Zipf popularity, shared across sessions) and a task, then `steps` (mean)
    rounds of (the model's tool call, the tool's result after an exponential latency). `rate`:
    new sessions per second on the trace clock (used when sessions follow their arrival times).
    `subagents`, `subagent_steps`, `lineage`: the module doc."""
    rng = random.Random(int(seed))
    weights = [1.0 / (k ** float(zipf)) for k in range(1, int(agent_types) + 1)]
    sys_len = [_lognormal(rng, float(system_tokens), 0.3) for _ in weights]
    built: dict[str, tuple[float, list[Round]]] = {}
    t = 0.0
    for n in range(int(sessions)):
        t += rng.expovariate(float(rate))
        sid = f"agent{n}"
        kind = rng.choices(range(len(weights)), weights)[0]
        count = max(1, int(rng.expovariate(1 / float(steps))) + 1)
        rows = [(0, _lognormal(rng, float(task_tokens), 0.3), _lognormal(rng, float(call_tokens), 0.4),
                 rng.expovariate(1 / float(tool_latency_s)))]
        for step in range(1, count):
            rows.append((step, _lognormal(rng, float(tool_result_tokens), 0.9),
                         _lognormal(rng, float(call_tokens), 0.4), rng.expovariate(1 / float(tool_latency_s))))
        rounds = _chain(sid, rows)
        rounds[0] = dataclasses.replace(rounds[0], system=(kind, sys_len[kind]))
        if int(subagents) > 0 and len(rounds) > 1:
            rounds = _fan_out(rng, rounds, (kind, sys_len[kind]), int(subagents), float(subagent_steps),
                              rows_of=lambda steps: _agent_rows(rng, steps, task_tokens, tool_result_tokens,
                                                                call_tokens, tool_latency_s),
                              names_parent=lineage not in ("0", "false", "off"))
        built[sid] = (t, rounds)
    return _trace(f"synthetic:agent-sessions(seed={seed})", built)


def _agent_rows(rng: random.Random, steps: float, task_tokens: str, tool_result_tokens: str, call_tokens: str,
                tool_latency_s: str) -> list[tuple[int, int, int, float]]:
    """A subagent's chain: its task, then tool calls and results (`agent_sessions`' distributions)."""
    count = max(1, int(rng.expovariate(1 / steps)) + 1)
    rows = [(0, _lognormal(rng, float(task_tokens), 0.3), _lognormal(rng, float(call_tokens), 0.4),
             rng.expovariate(1 / float(tool_latency_s)))]
    for step in range(1, count):
        rows.append((step, _lognormal(rng, float(tool_result_tokens), 0.9),
                     _lognormal(rng, float(call_tokens), 0.4), rng.expovariate(1 / float(tool_latency_s))))
    return rows


def _fan_out(rng: random.Random, rounds: list[Round], system: tuple[int, int], count: int, steps: float,
             rows_of: Callable[[float], list[tuple[int, int, int, float]]], names_parent: bool) -> list[Round]:
    """`rounds` (one agent's chain) with `count` parallel subagents spawned after one of its rounds:
    each starts its own conversation with the agent's system prompt (tools included), and the
    agent's next round waits for every subagent's last round."""
    spawn = rng.randrange(len(rounds) - 1)  # the round whose answer spawns them; the next one joins
    sid = rounds[0].session_id
    out = list(rounds)
    lasts: list[str] = []
    for j in range(count):
        agent = f"sub{j}"
        chain = _chain(f"{sid}/{agent}", rows_of(steps))
        chain = [dataclasses.replace(r, session_id=sid, agent=agent, names_parent=names_parent) for r in chain]
        first = chain[0]
        chain[0] = dataclasses.replace(first, wait_for=(rounds[spawn].key,), wait_s=rounds[spawn + 1].wait_s,
                                       system=system)
        out += chain
        lasts.append(chain[-1].key)
    join = rounds[spawn + 1]
    out[spawn + 1] = dataclasses.replace(join, wait_for=(*join.wait_for, *lasts))
    return out


# --- loading ----------------------------------------------------------------------------------

def _json_objects(text: str, name: str) -> Iterator[dict[str, Any]]:
    for lineno, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                obj = orjson.loads(line)
            except orjson.JSONDecodeError as exc:
                raise SessionFormatError(f"{name}:{lineno}: not JSON ({exc})") from None
            if not isinstance(obj, dict):
                raise SessionFormatError(f"{name}:{lineno}: not a JSON object")
            yield obj


def parse_sessions(text: str, name: str) -> SessionTrace | None:
    """The session trace in `text`, or None when it is not one of the session formats."""
    head = text.lstrip()[:4096]
    if head.startswith("{"):
        first = orjson.loads(head.splitlines()[0]) if head.splitlines() else {}
        if "newly_append_tokens" in first:
            return _tracelab_rounds(list(_json_objects(text, name)), name)
        if "request_id" in first and ("wait_for" in first or "session_id" in first):
            return _dynamo(list(_json_objects(text, name)), name)
        return None
    header = head.splitlines()[0] if head else ""
    columns = {c.strip() for c in header.split(",")}
    if {"session_id", "round_idx", "input_len", "output_len"} <= columns:
        return _tracelab_csv(text, name)
    return None


def is_session_spec(spec: str) -> bool:
    """Whether `spec` names a closed-loop session workload (a synthetic form or a session file)."""
    if spec.startswith("synthetic:"):
        return spec.startswith("synthetic:agent:") and "loop=closed" in spec
    path = Path(spec.partition("?")[0])
    if not path.is_file():
        return False
    return _sniff(path) is not None


def _read(path: Path) -> str:
    import gzip

    data = path.read_bytes()
    if data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    return data.decode("utf-8")


def _sniff(path: Path) -> SessionTrace | None:
    try:
        return parse_sessions(_read(path), path.name)
    except (UnicodeDecodeError, orjson.JSONDecodeError):
        return None


def load_sessions(spec: str) -> SessionTrace:
    """A session file (format told by content), optionally `FILE?copies=N[,stagger_s=S]`
    (`SessionTrace.copies`), or `synthetic:agent:loop=closed[,k=v...]`."""
    if spec.startswith("synthetic:agent:"):
        params = key_values(spec[len("synthetic:agent:"):], SessionFormatError)
        if params.pop("loop", None) != "closed":
            raise SessionFormatError(f"{spec}: session workloads are synthetic:agent:loop=closed[,...]")
        allowed = set(agent_sessions.__code__.co_varnames[:agent_sessions.__code__.co_argcount])
        unknown = sorted(set(params) - allowed)
        if unknown:
            raise SessionFormatError(f"{spec}: unknown parameter(s) {unknown}; known: {sorted(allowed)}")
        return agent_sessions(**params)
    file, _, query = spec.partition("?")
    tiling = key_values(query, SessionFormatError)
    unknown = sorted(set(tiling) - {"copies", "stagger_s"})
    if unknown:
        raise SessionFormatError(f"{spec}: unknown parameter(s) {unknown}; known: ['copies', 'stagger_s']")
    path = Path(file)
    if not path.is_file():
        raise SessionFormatError(f"session trace {file} does not exist")
    trace = parse_sessions(_read(path), path.name)
    if trace is None:
        raise SessionFormatError(f"{file} is not a session trace (TraceLab CSV or JSONL, Dynamo agentic JSONL)")
    try:
        count, stagger_s = int(tiling.get("copies", "1")), float(tiling.get("stagger_s", "0"))
    except ValueError as exc:
        raise SessionFormatError(f"{spec}: {exc}") from None
    return trace.copies(count, stagger_s)
