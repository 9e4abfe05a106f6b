"""The routing interface: every policy is `choose(view) -> Decision`.

`RoutingView` carries everything a policy may need, gathered before the call (prompt
size, block hashes, per-candidate cache overlap per tier, load, hardware speed), so
callers never branch on the concrete policy and policies stay pure functions of their
input (plus small state of their own, e.g. a round-robin cursor).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol


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
    BYPASS = "pd_bypass"  # small uncached part: decode worker prefills it itself


@dataclass(frozen=True)
class Candidate:
    worker_id: str
    hardware: str
    pool: str
    kv_format: str
    queued_prefill_tokens: int = 0  # last load report + this gateway's (and peers') in-flight prompts
    running: int = 0  # running sequences (decode load)
    dp_ranks: int = 1
    memory_hit_blocks: int = 0  # leading blocks of the prompt in this worker's memory tier
    store_hit_blocks: int = 0  # leading blocks in the shared store for this worker's KV format
    prefill_tokens_per_s: float = 300_000.0  # instance throughput (hardware cost table)
    kv_load_bytes_per_s: float = 25e9  # shared-store read bandwidth of this worker
    kv_bytes_per_token: float = 890.0


@dataclass(frozen=True)
class RoutingView:
    prompt_tokens: int
    candidates: tuple[Candidate, ...]
    block_hashes: tuple[int, ...] = ()
    block_tokens: int = 128
    session_key: str | None = None


@dataclass(frozen=True)
class Decision:
    worker_id: str
    reason: Reason
    costs: dict[str, float] = field(default_factory=dict)  # estimated seconds per candidate (debug log)
    predicted_memory_tokens: int = 0  # what the index expects the worker to report cached
    predicted_store_tokens: int = 0


class Policy(Protocol):
    name: str

    def choose(self, view: RoutingView) -> Decision:
        """`view.candidates` is non-empty and holds only healthy, compatible workers."""

    def observe(self, view: RoutingView, decision: Decision) -> None:
        """Called once the request went to `decision.worker_id` (policies with memory learn here)."""
