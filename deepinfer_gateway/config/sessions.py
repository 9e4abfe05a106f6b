"""`[session_capacity]`: each worker's live agent sessions kept within its KV cache
(router/session_capacity.py, docs/policies.md)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class SessionCapacitySettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = Field(
        False,
        description="Keep each worker's live sessions (a request's session: x-session-id and the agent clients' "
                    "headers, docs/api.md) within what its KV cache holds: a session's round that would evict "
                    "another live session's context waits in the gateway, first come first served: for the worker "
                    "its context is cached on, or, cached nowhere, for whichever worker of its pool has room first. "
                    "Needs workers that report their cache's "
                    "size (memory_capacity_blocks: sim and DeepInfer workers); others are not limited.")
    ttl_ms: float = Field(
        3_000.0, ge=0,
        description="A session stays live on its worker this long after its round ends (the agent's tool call "
                    "before its next round); a later round finds its context counted no more.")
    headroom: float = Field(
        0.1, ge=0, lt=1,
        description="Fraction of a worker's cache kept free of live sessions' contexts (the running rounds' "
                    "output, requests without a session).")
    max_wait_ms: float = Field(
        10_000.0, ge=0,
        description="Longest a round waits for room (on the worker its context is cached on, else on any of its "
                    "pool); past it, it goes anyway (dgw_session_proceeded_total).")
    hold_share: float = Field(
        0.5, gt=0, le=1,
        description="A round whose prompt a worker's cache holds at least this share of waits for that worker, "
                    "unless other workers cache nearly as much of it (less than this share of the prompt short: a "
                    "prefix every session shares): then it goes to whichever of them has room, or waits for the "
                    "first to have some. One cached less (a first round, a context already evicted) goes to a "
                    "worker with room, or waits for the first of its pool to have some.")
    shared: bool = Field(
        True,
        description="With redis.url: the routers that share the workers (gateway replicas, serve --processes) tell "
                    "each other their live sessions through Redis every share_interval_ms while they have session "
                    "traffic, and count the others' against each worker's room. Off: each counts its own only.")
    share_interval_ms: float = Field(
        100.0, gt=0, le=10_000,
        description="How often a router with live sessions exchanges them (shared); a report older than 10 intervals "
                    "counts for nothing.")
