"""Admission control as a pure function: the live gateway (gateway/serving/route_inputs.py) and the
simulator (simulate/gateway.py) refuse a request by the same rule."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from deepinfer_gateway.router.planner import WorkerView


def pool_queued_tokens(views: Sequence[WorkerView], pool: str) -> int:
    return sum(v.queued_prefill_tokens for v in views if v.pool == pool)


def retry_after(views: Sequence[WorkerView], pool: str, budget: int,
                prefill_speed: Callable[[str], float]) -> int | None:
    """Admission control: the seconds a client should wait when `pool`'s queued prefill
    tokens exceed `budget` (0: no limit), else None. `prefill_speed(hardware)`: tokens/s."""
    if not budget:
        return None
    members = [v for v in views if v.pool == pool]
    queued = sum(v.queued_prefill_tokens for v in members)
    if queued <= budget:
        return None
    return max(1, math.ceil((queued - budget) / sum(prefill_speed(v.hardware) for v in members)))
