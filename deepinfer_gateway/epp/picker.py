"""Which endpoints serve a request, and the load it books on the one that serves it.

`EndpointPicker.pick` runs the gateway's own routing (route_inputs.RouteInputs: the
worker views with this process's in-flight counts and shared reservations, the prefix
index lookup, the planner, admission; flow control's queue when it is on, as the gateway's:
gateway/serving/flow_gate.py) over the healthy unified workers, restricted to the
data plane's subset hint, and returns them in preference order: the planner's ranked plan, its
pick first, then its fallbacks (Envoy tries them in order when a connection fails). The policy
observes the pick alone, so a stateful one (round robin, session affinity, prefix_approx)
records where the request went, not the fallbacks.
PD pools are not served through the EPP: the data plane sends the client's body to one
endpoint, and a PD hand-off needs the gateway between the two legs.

The pick's `Booking` (router/booking.py) holds the chosen worker's in-flight count from the
pick to the end of the response, and its share of the worker's queue as the request path
books it (shared across replicas through Redis); the response's first bytes stand for the
engine's `ready`, which the EPP does not see. It moves to the endpoint the data plane
reports as the one that served (a fallback).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

from deepinfer_gateway.core.errors import NoHealthyWorker
from deepinfer_gateway.core.protocol import Role
from deepinfer_gateway.core.session_identity import SessionIdentity
from deepinfer_gateway.gateway.fleet.registry import WorkerRegistry, WorkerState
from deepinfer_gateway.gateway.serving.flow_gate import FlowGate, FlowTicket, Grant
from deepinfer_gateway.gateway.serving.route_inputs import RouteInputs
from deepinfer_gateway.gateway.telemetry.metrics import GatewayMetrics
from deepinfer_gateway.kvcache.types import Overlap
from deepinfer_gateway.recipe_bridge.prepared import PreparedRequest
from deepinfer_gateway.router.booking import Booking
from deepinfer_gateway.router.planner import Plan, WorkerView

# How long a picked request counts as starting (flow control) when neither its first bytes nor a
# load report said it started: the health interval's default.
STARTING_AT_MOST_S = 1.0


def endpoint_of(url: str) -> str:
    """`ip:port` of a worker's base URL, as the data plane dials it."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass(slots=True)
class Pick:
    workers: list[WorkerState]  # preference order; the first is booked
    plan: Plan
    booking: Booking[WorkerState]  # moved to the worker the data plane reports, ended with the response
    _metrics: GatewayMetrics
    grant: Grant | None = None  # flow control's (flow_gate.py), when on
    _on_end: Callable[[], None] | None = None

    @property
    def header(self) -> str:
        return ",".join(endpoint_of(w.url) for w in self.workers)

    def on_ready(self) -> None:
        """The response's first bytes: the engine started the request."""
        self.booking.on_ready(time.monotonic())  # the planner's clock
        if self.grant is not None:
            self.grant.started()

    def end(self) -> None:
        """The response's end, or the request's refusal: its load released (idempotent; synchronous, so
        that a cancelled stream's `finally` releases it for certain)."""
        if not self.booking.ended:
            self.booking.end()
            self._metrics.inflight.dec()
            if self.grant is not None:
                self.grant.ended()
            if self._on_end is not None:
                self._on_end()  # flow control looks again: the worker has room


class EndpointPicker:
    def __init__(self, registry: WorkerRegistry, routing: RouteInputs, metrics: GatewayMetrics, fallbacks: int,
                 gate: FlowGate | None = None):
        self.registry = registry
        self.routing = routing
        self.metrics = metrics
        self.fallbacks = fallbacks
        self.gate = gate  # flow control, when on: a request waits here for its pool, or is refused 429

    def by_endpoint(self, endpoint: str) -> WorkerState | None:
        """The worker whose URL dials `endpoint` (`ip:port`)."""
        for worker in self.registry.workers.values():
            if endpoint_of(worker.url) == endpoint:
                return worker
        return None

    def ready(self) -> bool:
        """Endpoints are known: at least one unified worker is healthy."""
        return any(w.spec.role == Role.UNIFIED for w in self.registry.healthy())

    async def _eligible(self, subset: frozenset[str] | None) -> list[WorkerView]:
        views = [v for v in await self.routing.views() if v.role == Role.UNIFIED]
        if subset is not None:
            urls = {w.worker_id: w.url for w in self.registry.workers.values()}
            views = [v for v in views if endpoint_of(urls[v.worker_id]) in subset]
        if not views:
            where = "in the subset hint" if subset is not None else "in the pool"
            raise NoHealthyWorker(f"No eligible endpoint {where} can serve this request; retry shortly.")
        return views

    async def pick(self, prepared: PreparedRequest | None, subset: frozenset[str] | None, request_id: str,
                   session: SessionIdentity | None = None, flow: FlowTicket | None = None,
                   arrival: float = 0.0) -> Pick:
        """The endpoints for a request (`prepared`: None when the path carries no generation body);
        NoHealthyWorker (503) when none is eligible, Overloaded (429) when admission or flow control
        (`flow`: its ticket; it may wait here first) sheds it."""
        views = await self._eligible(subset)
        hashes: dict[str, list[int]] = {}
        overlap = Overlap()
        prompt_tokens = 0
        if prepared is not None:
            prompt_tokens = prepared.prompt_tokens
            hashes, overlap = await self.routing.overlap(prepared, views)
            if session is not None:
                self.routing.observe_session(session, hashes)
        grant = None
        if self.gate is not None and flow is not None and prepared is not None:
            pool = self.routing.planner.first_pool(views, prompt_tokens, overlap)
            grant = await self.gate.admit(flow, prompt_tokens, pool, views, arrival)
        try:
            if grant is not None and grant.waited_s:  # the load and the caches moved while it waited
                assert prepared is not None
                views = await self._eligible(subset)
                hashes, overlap = await self.routing.overlap(prepared, views)
            return await self._planned(prepared, views, hashes, overlap, prompt_tokens, request_id, session, grant)
        except BaseException:
            if grant is not None:
                grant.ended()
            raise

    async def _planned(self, prepared: PreparedRequest | None, views: list[WorkerView], hashes: dict[str, list[int]],
                       overlap: Overlap, prompt_tokens: int, request_id: str, session: SessionIdentity | None,
                       grant: Grant | None) -> Pick:
        session = session or SessionIdentity()
        lineage = await self.routing.lineage(session)
        views = self.routing.current(views)  # with the picks booked since they were read
        plan = self.routing.planner.plan_first(views, prompt_tokens, hashes, overlap, session.session,
                                               fallbacks=self.fallbacks, lineage=lineage)
        if prepared is not None:
            self.routing.admit(plan, views)
        self.routing.record(plan, request_id, hashes)
        chosen = [plan.worker.worker_id, *(w.worker_id for w in plan.fallbacks)]
        workers = [self.registry.workers[w] for w in chosen if w in self.registry.workers]
        if not workers:
            raise NoHealthyWorker("No eligible endpoint can serve this request; retry shortly.")
        worker = workers[0]
        booking = Booking(self.routing.inflight, worker, request_id, prompt_tokens,
                          plan.decision.predicted_memory_tokens)
        self.metrics.inflight.inc()
        if booking.queued and worker.upstream.reports_queue:  # a report probed from now on counts the request
            self.registry.after_report(worker, self.registry.loop_lag.now(), booking.on_report)
        try:  # after the booking: a pick planned while this one awaits counts it
            await self.routing.remember(session, plan)
        except BaseException:  # cancelled (the stream went away): nothing was picked
            booking.end()
            self.metrics.inflight.dec()
            raise
        if grant is not None:
            grant.booked()
            # The EPP sees a response's first bytes, not the engine's start: a non-streaming answer's
            # come at its end. A load report probed from now on counts the request (waiting or
            # running), so flow control counts it as starting until then, and a worker pushing its
            # reports only on change may send none: `STARTING_AT_MOST_S` at most.
            self.registry.after_report(worker, self.registry.loop_lag.now(), grant.started)
            asyncio.get_running_loop().call_later(STARTING_AT_MOST_S, grant.started)
        return Pick(workers, plan, booking, self.metrics, grant, self.gate.wake if self.gate is not None else None)
