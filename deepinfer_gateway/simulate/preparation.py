"""The gateway's preparation time in virtual time (`config.GatewayCost`): when each request
is routed, and when a first token produced during an event-loop busy period reaches the client."""

from __future__ import annotations

import bisect
import random
from collections.abc import Sequence

from deepinfer_gateway.simulate.config import GatewayCost
from deepinfer_gateway.workload.types import RequestRecord, TraceRequest


class PreparationLanes:
    def __init__(self, cost: GatewayCost, template_tokens: int) -> None:
        self.cost = cost
        self.template_tokens = template_tokens  # header + trailer the chat template adds to each prompt
        # The event loop's preparation busy periods (serial, relay_waits): [start, end) each.
        self._busy_starts: list[float] = []
        self._busy_ends: list[float] = []
        self._free = [0.0, 0.0]
        self._rng: random.Random | None = None
        self.reset()

    def route_times(self, requests: Sequence[TraceRequest], records: Sequence[RequestRecord]) -> list[float]:
        """When each request is routed: arrival + the gateway's preparation cost (config.GatewayCost),
        queued behind the previous request's in its lane when the gateway is serial: the event
        loop's, or, for prompts of `offload_tokens` or more, the preparation thread's. Records
        the busy periods of the loop lane (for `relay_waits`). Starts the lanes afresh."""
        self.reset()
        route = self.route_at
        return [route(record.arrival_s, request.input_length)
                for request, record in zip(requests, records, strict=True)]

    def reset(self) -> None:
        self._busy_starts.clear()
        self._busy_ends.clear()
        self._free = [0.0, 0.0]  # loop lane, thread lane
        self._rng = random.Random(self.cost.seed) if self.cost.jitter else None

    def route_at(self, arrival_s: float, input_tokens: int) -> float:
        """When a request arriving at `arrival_s` (no earlier than the previous call's) with
        `input_tokens` before the template is routed, as `route_times` does one by one."""
        gw = self.cost
        tokens = input_tokens + self.template_tokens
        cost = gw.request_overhead_s + gw.per_prompt_token_s * tokens
        if self._rng is not None:
            cost *= self._rng.lognormvariate(0.0, gw.jitter)
        free = self._free
        lane = 1 if gw.offload_tokens is not None and tokens >= gw.offload_tokens else 0
        start = max(arrival_s, free[lane]) if gw.serial else arrival_s
        at = start + cost
        if gw.serial and gw.relay_waits and lane == 0 and cost > 0.0:
            ends = self._busy_ends
            if ends and start <= ends[-1]:
                ends[-1] = at
            else:
                self._busy_starts.append(start)
                ends.append(at)
        free[lane] = at
        return at

    def relayed(self, t: float) -> float:
        """When a token the engine produced at t reaches the client: at the end of the gateway's
        event-loop preparation busy period that t falls in, if any (`GatewayCost.relay_waits`)."""
        i = bisect.bisect_right(self._busy_starts, t) - 1
        if i >= 0 and t < self._busy_ends[i]:
            return self._busy_ends[i]
        return t
