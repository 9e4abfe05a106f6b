"""Built-in synthetic workloads with prefix structure, as hash-id traces.

Both generators describe each request's prompt as a list of *segments* (a shared
system prompt, a user turn, an earlier answer, a tool result) and turn it into a
Mooncake-style chain of block ids (`BlockChain`): a block's id is determined by the
id of the block before it and the exact segment pieces it covers, so equal prefixes get
equal ids and a block that is later extended (a partial last block) gets a new id.
The prompts are then synthesized like any hash-id trace (see `synthesis.py`).

- `chat`: multi-turn sessions; each session's system prompt is drawn from a small
  pool with Zipf popularity (shared across sessions); each turn appends the previous
  answer and a new user message.
- `agent`: agent loops; a long tool-spec system prompt per agent type (Zipf), a task,
  then steps of (short tool-call output, tool result appended) with tool latency
  between steps, so the context grows every step.

Tool calls are modelled as context growth (blocks of the prompt), not as protocol-level
`tools`/`tool_calls` messages: the cache behaviour is what is measured.
All parameters are keyword strings (they come from `synthetic:KIND:key=value,...`).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

from deepinfer_gateway.workload.types import MOONCAKE_BLOCK_TOKENS, Trace, TraceRequest

Segment = tuple[str, int]  # (globally unique content key, length in tokens)


class BlockChain:
    """Assigns chained block ids to segment lists (one id table per trace)."""

    def __init__(self, block_size: int = MOONCAKE_BLOCK_TOKENS):
        self.block_size = block_size
        self._ids: dict[tuple[object, ...], int] = {}

    def ids(self, segments: list[Segment]) -> tuple[int, ...]:
        pieces: list[tuple[str, int, int]] = []  # (key, start, end) inside the segment
        out: list[int] = []
        prev = -1
        filled = 0
        for key, length in segments:
            start = 0
            while start < length:
                take = min(length - start, self.block_size - filled)
                pieces.append((key, start, start + take))
                start += take
                filled += take
                if filled == self.block_size:
                    prev = self._id(prev, pieces)
                    out.append(prev)
                    pieces, filled = [], 0
        if pieces:
            out.append(self._id(prev, pieces))
        return tuple(out)

    def _id(self, prev: int, pieces: list[tuple[str, int, int]]) -> int:
        key = (prev, *pieces)
        return self._ids.setdefault(key, len(self._ids))


def _zipf_picker(rng: random.Random, n: int, s: float) -> Callable[[], int]:
    weights = [1.0 / (k ** s) for k in range(1, n + 1)]
    population = list(range(n))
    return lambda: rng.choices(population, weights)[0]


def _lognormal(rng: random.Random, mean: float, sigma: float = 0.6) -> int:
    mu = math.log(mean) - sigma * sigma / 2
    return max(1, int(rng.lognormvariate(mu, sigma)))


@dataclass
class _Pending:
    arrival_s: float
    segments: list[Segment]
    output_length: int


def _to_trace(name: str, pending: list[_Pending], requests: int, chain: BlockChain) -> Trace:
    pending.sort(key=lambda p: p.arrival_s)
    pending = pending[:requests]
    t0 = pending[0].arrival_s if pending else 0.0
    out = []
    for i, p in enumerate(pending):
        ids = chain.ids(p.segments)
        out.append(TraceRequest(i, p.arrival_s - t0, sum(n for _, n in p.segments), p.output_length, ids))
    return Trace(name, tuple(out), chain.block_size)


def chat(requests: str = "1000", rate: str = "4", seed: str = "0", system_prompts: str = "16",
         zipf: str = "1.1", system_tokens: str = "2000", user_tokens: str = "300", output_tokens: str = "300",
         turns: str = "5", think_s: str = "20") -> Trace:
    """Multi-turn chat; `rate` is requests/s overall, `turns` the mean turns per session."""
    n, rps, mean_turns = int(requests), float(rate), float(turns)
    rng = random.Random(int(seed))
    pick = _zipf_picker(rng, int(system_prompts), float(zipf))
    sys_len = [_lognormal(rng, float(system_tokens)) for _ in range(int(system_prompts))]
    pending: list[_Pending] = []
    t = 0.0
    session = 0
    while len(pending) < 2 * n:
        t += rng.expovariate(rps / mean_turns)
        k = pick()
        context: list[Segment] = [(f"sys{k}", sys_len[k])]
        arrival = t
        for turn in range(max(1, int(rng.expovariate(1 / mean_turns)) + 1)):
            context.append((f"s{session}u{turn}", _lognormal(rng, float(user_tokens))))
            out_len = _lognormal(rng, float(output_tokens))
            pending.append(_Pending(arrival, list(context), out_len))
            context.append((f"s{session}a{turn}", out_len))
            arrival += rng.expovariate(1 / float(think_s))
        session += 1
    return _to_trace(f"synthetic:chat(seed={seed})", pending, n, BlockChain())


def agent(requests: str = "1000", rate: str = "4", seed: str = "0", agent_types: str = "4", zipf: str = "1.0",
          system_tokens: str = "6000", task_tokens: str = "500", tool_result_tokens: str = "700",
          call_tokens: str = "80", steps: str = "12", tool_latency_s: str = "1.5") -> Trace:
    """Agent loops; `rate` is requests/s overall, `steps` the mean steps (requests) per task."""
    n, rps, mean_steps = int(requests), float(rate), float(steps)
    rng = random.Random(int(seed))
    pick = _zipf_picker(rng, int(agent_types), float(zipf))
    sys_len = [_lognormal(rng, float(system_tokens), 0.3) for _ in range(int(agent_types))]
    pending: list[_Pending] = []
    t = 0.0
    task = 0
    while len(pending) < 2 * n:
        t += rng.expovariate(rps / mean_steps)
        k = pick()
        context: list[Segment] = [(f"tools{k}", sys_len[k]), (f"t{task}task", _lognormal(rng, float(task_tokens)))]
        arrival = t
        for step in range(max(1, int(rng.expovariate(1 / mean_steps)) + 1)):
            out_len = _lognormal(rng, float(call_tokens), 0.4)
            pending.append(_Pending(arrival, list(context), out_len))
            context.append((f"t{task}c{step}", out_len))
            context.append((f"t{task}r{step}", _lognormal(rng, float(tool_result_tokens), 0.9)))
            arrival += rng.expovariate(1 / float(tool_latency_s))
        task += 1
    return _to_trace(f"synthetic:agent(seed={seed})", pending, n, BlockChain())


GENERATORS: dict[str, Callable[..., Trace]] = {"chat": chat, "agent": agent}
