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

    def route_times(self, requests: Sequence[TraceRequest], records: Sequence[RequestRecord]) -> list[float]:
        """When each request is routed: arrival + the gateway's preparation cost (config.GatewayCost),
        queued behind the previous request's in its lane when the gateway is serial: the event
        loop's, or, for prompts of `offload_tokens` or more, the preparation thread's. Records
        the busy periods of the loop lane (for `relay_waits`)."""
        gw = self.cost
        extra = self.template_tokens
        rng = random.Random(gw.seed) if gw.jitter else None
        starts, ends = self._busy_starts, self._busy_ends
        starts.clear()
        ends.clear()
        free = [0.0, 0.0]  # loop lane, thread lane
        out = []
        for request, record in zip(requests, records, strict=True):
            tokens = request.input_length + extra
            cost = gw.request_overhead_s + gw.per_prompt_token_s * tokens
            if rng is not None:
                cost *= rng.lognormvariate(0.0, gw.jitter)
            lane = 1 if gw.offload_tokens is not None and tokens >= gw.offload_tokens else 0
            start = max(record.arrival_s, free[lane]) if gw.serial else record.arrival_s
            at = start + cost
            if gw.serial and gw.relay_waits and lane == 0 and cost > 0.0:
                if ends and start <= ends[-1]:
                    ends[-1] = at
                else:
                    starts.append(start)
                    ends.append(at)
            free[lane] = at
            out.append(at)
        return out

    def relayed(self, t: float) -> float:
        """When a token the engine produced at t reaches the client: at the end of the gateway's
        event-loop preparation busy period that t falls in, if any (`GatewayCost.relay_waits`)."""
        i = bisect.bisect_right(self._busy_starts, t) - 1
        if i >= 0 and t < self._busy_ends[i]:
            return self._busy_ends[i]
        return t
