"""The routing interface: every policy is `choose(view) -> Decision`.

`RoutingView` carries everything a policy may need, gathered before the call (token
count, per-candidate cache overlap per tier, load), so callers never branch on the
concrete policy and policies stay pure functions of their input (plus their own small
state, e.g. a round-robin cursor).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol


class Reason(StrEnum):
    """Why a worker was chosen; a bounded metrics label."""

    ROUND_ROBIN = "round_robin"
    LEAST_LOAD = "least_load"
    PREFIX_HIT = "prefix_hit"
    STORE_HIT = "store_hit"
    LOAD_FALLBACK = "load_fallback"
    AFFINITY = "affinity"
    BYPASS = "pd_bypass"


@dataclass(frozen=True)
class Candidate:
    worker_id: str
    hardware: str
    pool: str
    kv_format: str
    queued_prefill_tokens: int = 0  # from the worker's last load report + our in-flight estimate
    running: int = 0
    memory_hit_blocks: int = 0  # leading blocks in this worker's memory tier
    store_hit_blocks: int = 0  # leading blocks in the shared store for this worker's KV format


@dataclass(frozen=True)
class RoutingView:
    prompt_tokens: int
    candidates: tuple[Candidate, ...]
    block_tokens: int = 128
    session_key: str | None = None


@dataclass(frozen=True)
class Decision:
    worker_id: str
    reason: Reason
    costs: dict[str, float] = field(default_factory=dict)  # per candidate, for the debug log


class Policy(Protocol):
    name: str

    def choose(self, view: RoutingView) -> Decision:
        """`view.candidates` is non-empty and holds only healthy, compatible workers."""
