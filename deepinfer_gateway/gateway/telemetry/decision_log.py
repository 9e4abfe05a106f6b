"""A routing decision trace: one JSON line per request, when `router.decision_log` names a file.

Each line says what the router saw and chose and what then happened, so a benchmark's slow
tail can be traced to its decisions (bench/decision_report.py): the chosen worker and the
policy's reason; per candidate its predicted memory-tier hit (tokens), queued prefill tokens
and running sequences at decision time (the queue's parts: the load report's figure, the
report's age, this gateway's bookings), the requests this process has sent it that share its
next step or are in the step under way (what lockstep pricing reads), and the policy's
estimated seconds where it has them; the index's prediction against the cached tokens the
worker reported in `ready`; and the request's own timings (arrival to the worker's `ready`, to
the first token), plus how far this process's event loop was held up meanwhile. Off by
default: a line costs ~20 us.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import IO, Any

import orjson

from deepinfer_gateway.router.planner import Plan, WorkerView
from deepinfer_gateway.router.policy import Candidate


def decision_record(plan: Plan, request_id: str, ready: dict[str, Any], *, arrival: float, ready_at: float,
                    first_at: float, loop_stall_s: float, views: Sequence[WorkerView] = ()) -> dict[str, Any]:
    """The trace line of one request (times: `time.perf_counter` values, reported relative to arrival;
    `views`: what the plan was made from, for each candidate's queue parts)."""
    view, decision = plan.view, plan.decision
    costs = decision.costs
    block = view.block_tokens
    cached = ready.get("cached_tokens") or {}
    parts = {v.worker_id: v for v in views}
    return {
        "t": round(time.time(), 3),
        "request_id": request_id,
        "prompt_tokens": view.prompt_tokens,
        "mode": plan.mode,
        "worker": decision.worker_id,
        "reason": str(decision.reason),
        "predicted": {"memory": decision.predicted_memory_tokens, "store": decision.predicted_store_tokens},
        "reported": {"memory": int(cached.get("memory", 0)), "store": int(cached.get("store", 0))},
        "queue_s": round(ready_at - arrival, 4),
        "first_token_s": round(first_at - arrival, 4),
        "loop_stall_s": round(loop_stall_s, 4),
        "candidates": [
            {"worker": c.worker_id, "hardware": c.hardware, "hit_tokens": min(c.memory_hit_blocks * block,
                                                                               view.prompt_tokens),
             "queued_tokens": c.queued_prefill_tokens, "running": c.running,
             "estimate_s": costs.get(c.worker_id) if costs else None, **_queue_parts(parts.get(c.worker_id)),
             **_crowd(c, view.now)}
            for c in view.candidates],
    }


def _queue_parts(view: WorkerView | None) -> dict[str, Any]:
    """Where a candidate's queue came from: the load report (and its age) and the bookings
    (`reported_tokens` None where their sum was below 0 and the queue taken as 0)."""
    if view is None:
        return {}
    queued, booked = view.queued_prefill_tokens, view.booked_tokens
    return {"reported_tokens": queued - booked if queued or booked >= 0 else None, "booked_tokens": booked,
            "load_age_s": view.load_age_s}


def _crowd(candidate: Candidate, now: float) -> dict[str, Any]:
    """What lockstep pricing reads (router/booking.py): this process's requests sent to the worker and
    not yet scheduled, the largest one it scheduled that has no first token yet, and how long ago the
    last of those was scheduled (None: none)."""
    since = candidate.prefilling_since
    return {"admitting": candidate.admitting, "admitting_tokens": candidate.admitting_tokens,
            "admitting_max": candidate.admitting_max, "prefilling_max": candidate.prefilling_max,
            "prefilling_age_s": round(now - since, 4) if since else None}


class DecisionLog:
    """Appends decision records to a file, one line each (line-buffered: several processes of
    one gateway may share the file; each line is one write)."""

    def __init__(self, path: str):
        self._file: IO[bytes] = open(path, "ab", buffering=0)  # held for the process's life

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(orjson.dumps(record) + b"\n")

    def close(self) -> None:
        self._file.close()
