"""The routing interface: every policy is `choose(view) -> Decision`.

`RoutingView` carries everything a policy may need, gathered before the call (prompt
size, block hashes, per-candidate cache overlap per tier, load, hardware speed), so
callers never branch on the concrete policy and policies stay pure functions of their
input (plus small state of their own, e.g. a round-robin cursor, which only `observe` changes).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from itertools import repeat
from operator import attrgetter, truediv
from typing import Any, Protocol


class Reason(StrEnum):
    """Why a worker was chosen; a bounded metrics label."""

    ROUND_ROBIN = "round_robin"
    LEAST_LOAD = "least_load"
    POWER_OF_TWO = "power_of_two"
    PREFIX_HIT = "prefix_hit"  # the chosen worker's memory holds a prefix of the prompt
    STORE_HIT = "store_hit"  # no memory hit worth it; the shared store's prefix is loaded
    COLD = "cold"  # no cached prefix anywhere: cheapest by queue and speed
    LOAD_FALLBACK = "load_fallback"  # the load guard overrode the cache preference
    QUEUE_OVER_CACHE = "queue_over_cache"  # a shorter queue outweighed another worker's longer memory hit
    AFFINITY = "affinity"
    LINEAGE = "lineage"  # a subagent's first request, on its parent's worker (its shared prefix)
    BYPASS = "pd_bypass"  # small uncached part: decode worker prefills it itself


@dataclass(frozen=True)
class Candidate:
    worker_id: str
    hardware: str
    pool: str
    kv_format: str
    queued_prefill_tokens: int = 0  # last load report + this gateway's (and peers') in-flight prompts
    running: int = 0  # running sequences (decode load)
    admitting: int = 0  # requests sent to it and not yet scheduled: its next step's (router/booking.py)
    admitting_tokens: int = 0  # their uncached parts' sum
    admitting_max: int = 0  # the largest uncached part among them
    prefilling_max: int = 0  # the largest uncached part of those it scheduled, no first token yet: the step under way
    prefilling_since: float = 0.0  # when the last of them was scheduled (RoutingView.now's clock)
    dp_ranks: int = 1
    memory_hit_blocks: int = 0  # leading blocks of the prompt in this worker's memory tier
    store_hit_blocks: int = 0  # leading blocks in the shared store for this worker's KV format
    prefill_tokens_per_s: float = 300_000.0  # instance throughput (hardware cost table)
    kv_load_bytes_per_s: float = 25e9  # shared-store read bandwidth of this worker
    kv_bytes_per_token: float = 890.0


# The hardware side of a candidate's cost estimate (router/policies.py).
PROFILE: Any = attrgetter("dp_ranks", "prefill_tokens_per_s", "kv_bytes_per_token", "kv_load_bytes_per_s")


@dataclass(slots=True)
class Columns:
    """The candidates as columns, index i = candidates[i]: what policies scan over a fleet pool
    with C-level passes (map, min, compress) instead of a Python loop over objects.
    `profile_values[profiles[i]]` is `PROFILE(candidates[i])` (it may hold profiles no
    candidate has: the planner keeps them across requests)."""

    ids: list[str]
    queues: list[int]  # queued_prefill_tokens
    running: list[int]
    hits: list[int]  # memory_hit_blocks
    stored: list[int]  # store_hit_blocks
    waits: list[float]  # queued_prefill_tokens / prefill_tokens_per_s
    crowds: list[tuple[int, int, int, int, float]]  # CROWD of each candidate
    profiles: list[int]
    profile_values: list[tuple[Any, ...]]


_QUEUE = attrgetter("queued_prefill_tokens")
CROWD: Any = attrgetter("admitting", "admitting_tokens", "admitting_max", "prefilling_max", "prefilling_since")
_SPEED = attrgetter("prefill_tokens_per_s")


def columns_of(candidates: Sequence[Candidate]) -> Columns:
    """`Columns` built from the candidates (the planner keeps its own up to date instead)."""
    profiles = list(map(PROFILE, candidates))
    profile_values = list(dict.fromkeys(profiles))
    index = {value: k for k, value in enumerate(profile_values)}
    queues = list(map(_QUEUE, candidates))
    return Columns(
        ids=[c.worker_id for c in candidates], queues=queues, running=[c.running for c in candidates],
        hits=[c.memory_hit_blocks for c in candidates], stored=[c.store_hit_blocks for c in candidates],
        waits=list(map(truediv, queues, map(_SPEED, candidates))), crowds=list(map(CROWD, candidates)),
        profiles=list(map(index.__getitem__, profiles)), profile_values=profile_values,
    )


@dataclass(frozen=True)
class Lineage:
    """A request's parent session and, when the gateway replicas share one, what their store
    remembers: the shell reads it; the policy stays pure."""

    parent_key: str | None = None  # the parent session, for a subagent's requests
    shared: bool = False  # the two workers below come from the replicas' shared store
    session_worker: str | None = None  # where the session's last request went
    parent_worker: str | None = None  # where its parent's last request went


@dataclass(frozen=True)
class RoutingView:
    prompt_tokens: int
    candidates: Sequence[Candidate]  # a tuple, or the planner's lazily built equivalent
    block_hashes: tuple[int, ...] = ()
    block_tokens: int = 128
    session_key: str | None = None
    lineage: Lineage | None = None
    now: float = 0.0  # the planner's clock (Candidate.prefilling_since)
    # The candidates as columns when the caller keeps them (the planner); else built on use.
    columns: Columns | None = field(default=None, compare=False, repr=False)

    def table(self) -> Columns:
        return self.columns if self.columns is not None else columns_of(self.candidates)


class LazyCosts(Mapping[str, float]):
    """`worker id -> estimated seconds` (rounded to the microsecond), built when first read:
    only a debug log reads it, and rounding a fleet pool's estimates costs more than choosing."""

    __slots__ = ("_ids", "_seconds", "_dict")

    def __init__(self, ids: list[str], seconds: list[float]) -> None:
        self._ids, self._seconds = ids, seconds
        self._dict: dict[str, float] | None = None

    def _built(self) -> dict[str, float]:
        if self._dict is None:
            self._dict = dict(zip(self._ids, map(round, self._seconds, repeat(6)), strict=True))
        return self._dict

    def __getitem__(self, worker_id: str) -> float:
        return self._built()[worker_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._built())

    def __len__(self) -> int:
        return len(self._built())

    def __repr__(self) -> str:
        return repr(self._built())


@dataclass(frozen=True)
class Decision:
    worker_id: str
    reason: Reason
    costs: Mapping[str, float] = field(default_factory=dict)  # estimated seconds per candidate (debug log)
    predicted_memory_tokens: int = 0  # what the index expects the worker to report cached
    predicted_store_tokens: int = 0


class Policy(Protocol):
    name: str

    def choose(self, view: RoutingView) -> Decision:
        """`view.candidates` is non-empty and holds only healthy, compatible workers. Changes no
        state: the planner also calls it to rank fallbacks, which no request may go to."""

    def observe(self, view: RoutingView, decision: Decision) -> None:
        """Called once per request, for the worker it went to (a round-robin turn, a session's
        worker, a routed prefix: whatever a policy remembers changes here alone)."""
