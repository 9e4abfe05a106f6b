"""`WorkerView`: one worker as the planner sees it (the gateway builds it from the registry and
load reports, gateway/serving/route_inputs.py; the simulator from its workers)."""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer_gateway.core.protocol import Role


@dataclass(frozen=True)
class WorkerView:
    worker_id: str
    role: Role
    pool: str
    hardware: str
    kv_format: str
    model: str
    queued_prefill_tokens: int = 0  # reported + booked, at least 0
    booked_tokens: int = 0  # of which the gateway's bookings (router/booking.py `Booking`)
    own_booked: int = 0  # of which this process's own (the request path adds what it booked since)
    load_age_s: float = 0.0  # how old the load report is (since its probe began); the decision log reads it
    running: int = 0
    admitting: int = 0  # this process's requests sent to it and not yet scheduled (router/booking.py)
    admitting_tokens: int = 0  # their uncached parts' sum
    admitting_max: int = 0  # the largest uncached part among them
    prefilling_max: int = 0  # the largest uncached part of those it scheduled, no first token yet
    prefilling_since: float = 0.0  # when the last of them was scheduled (the planner's clock)
    waiting: int = 0  # requests the engine holds, not yet running (last load report): flow control reads it
    kv_usage: float = 0.0  # of its KV memory, 0..1 (last load report)
    dp_ranks: int = 1
    slots: int = 0  # sequences it runs at once, all DP ranks (0: unknown); flow control's flex share
    prefills: bool = True  # a decode worker that can take a PD bypass
    preempts: bool = False  # it schedules by the requests' priority and preempts (flow control reads it)
