"""One request's metrics from its first leg to its end, recorded by one owner.

`RequestOutcome` is made once the first leg reached its first token (server.py) and ended
once, in `Relay.close` (relay.py): queue time and prompt length at the start, TTFT at the
first token, ITL per relayed token message (`itl`, added to `series.itl` in batches), and at
the end the output length, duration, generation tokens, the outcome in
`dgw_requests_total` and the prompt and cached tokens against the router's prediction (at
the end: an engine that reports its cached count only then, vLLM, brings it on `finish`).
Requests answered before a worker was reached are counted by the edge (routes.py).
"""

from __future__ import annotations

import time
from typing import Any

from deepinfer_gateway.gateway.fleet.registry import WorkerState
from deepinfer_gateway.gateway.telemetry.metrics import GatewayMetrics
from deepinfer_gateway.gateway.telemetry.tally import HistogramTally
from deepinfer_gateway.recipe_bridge.prepare import PreparedRequest
from deepinfer_gateway.router.planner import Plan


class RequestOutcome:
    """The metrics of one request that reached a worker (module doc)."""

    __slots__ = ("_metrics", "_prepared", "_plan", "arrival", "ready", "first_series", "series", "itl", "status")

    def __init__(self, metrics: GatewayMetrics, prepared: PreparedRequest, plan: Plan, arrival: float,
                 ready: dict[str, Any], worker: WorkerState):
        self._metrics = metrics
        self._prepared = prepared
        self._plan = plan
        self.arrival = arrival  # perf_counter at arrival: TTFT, queue time and duration start here
        self.ready = ready  # the first leg's `ready`; its cached count the final one once `finish` brings it
        # The first leg's (model, pool, hardware): TTFT, queue time, prompt length.
        self.first_series = metrics.request_series(prepared.model, plan.worker.pool, plan.worker.hardware)
        self.series = self.first_series  # the current leg's: ITL, duration, output length
        self.itl = HistogramTally(self.series.itl)  # one observation per relayed chunk: batched (tally.py)
        if worker.worker_id != plan.worker.worker_id:  # a prefill that handed off before any token (vLLM)
            self.decode_leg(worker)
        self.status: str | None = None  # 200, 502 (streams; 499: the client left first); None: the app counts it

    def started(self, ready_at: float) -> None:
        """The first leg's `ready` came at `ready_at` (perf_counter)."""
        self.first_series.queue.observe(ready_at - self.arrival)
        self.first_series.prompt_len.observe(self.ready["prompt_tokens"])

    def first_token(self, at: float) -> None:
        self.first_series.ttft.observe(at - self.arrival)

    def decode_leg(self, worker: WorkerState) -> None:
        """A decode leg on `worker` continues the request: its later figures are that pool's."""
        self.series = self._metrics.request_series(self._prepared.model, worker.pool, worker.spec.hardware)
        self.itl.flush()
        self.itl = HistogramTally(self.series.itl)

    def final_cached(self, cached_tokens: dict[str, int]) -> None:
        """The engine's real cached count where `ready`'s was provisional (vLLM's `finish`)."""
        self.ready = {**self.ready, "cached_tokens": cached_tokens}

    def client_left(self) -> None:
        if self.status is None:
            self.status = "499"
            self._metrics.client_disconnects.inc()

    def end(self, completion_tokens: int) -> None:
        """Everything recorded at the end; once (`Relay.close`)."""
        metrics = self._metrics
        self.itl.flush()
        metrics.generation_tokens.inc(completion_tokens)
        self.series.output_len.observe(completion_tokens)
        self.series.duration.observe(time.perf_counter() - self.arrival)
        if self.status is not None:
            metrics.count_request(str(self._prepared.protocol), self._prepared.model, self.status)
        self._count_prompt()

    def _count_prompt(self) -> None:
        """Prompt and cached tokens as the worker reported them, against what routing predicted."""
        metrics, decision, ready = self._metrics, self._plan.decision, self.ready
        prompt = ready["prompt_tokens"]
        reported = ready["cached_tokens"]
        predicted = {"memory": decision.predicted_memory_tokens, "store": decision.predicted_store_tokens}
        metrics.prompt_tokens.inc(prompt)
        for tier in ("memory", "store"):
            if reported.get(tier):
                metrics.cached_tokens.labels(tier).inc(reported[tier])
            if predicted[tier]:
                metrics.predicted_cached_tokens.labels(tier).inc(predicted[tier])
        error = (predicted["memory"] + predicted["store"] - reported["memory"] - reported["store"]) / max(prompt, 1)
        metrics.prediction_error.observe(error)


