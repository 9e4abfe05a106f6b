"""Which endpoints serve a request, and the load it books on the one that serves it.

`EndpointPicker.pick` runs the gateway's own routing (route_inputs.RouteInputs: the
worker views with this process's in-flight counts and shared reservations, the prefix
index lookup, the planner, admission) over the healthy unified workers, restricted to the
data plane's subset hint, and returns them in preference order: the planner's ranked plan, its
pick first, then its fallbacks (Envoy tries them in order when a connection fails). The policy
observes the pick alone, so a stateful one (round robin, session affinity, prefix_approx)
records where the request went, not the fallbacks.
PD pools are not served through the EPP: the data plane sends the client's body to one
endpoint, and a PD hand-off needs the gateway between the two legs.

A `Booking` holds the chosen worker's in-flight count from the pick to the end of the
response, and its share of the worker's queue as the request path books it (shared across
replicas through Redis) until the response starts; it follows the data plane's report of
the endpoint that actually served.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

from deepinfer_gateway.errors import NoHealthyWorker
from deepinfer_gateway.gateway.fleet.registry import WorkerRegistry, WorkerState
from deepinfer_gateway.gateway.serving.background import run_in_background
from deepinfer_gateway.gateway.serving.route_inputs import RouteInputs
from deepinfer_gateway.gateway.telemetry.metrics import GatewayMetrics
from deepinfer_gateway.kvcache.types import Overlap
from deepinfer_gateway.protocol import Role
from deepinfer_gateway.recipe_bridge.prepared import PreparedRequest
from deepinfer_gateway.router.inflight import Booking as QueueBooking
from deepinfer_gateway.router.planner import Plan


def endpoint_of(url: str) -> str:
    """`ip:port` of a worker's base URL, as the data plane dials it."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class Booking:
    """One request's load on the worker serving it (module doc): its in-flight count until `end`
    (idempotent), and in its queue what the request path books (router/inflight.py's rule:
    the uncached prompt until a load report counts it, minus the cached part after, nothing
    once it runs; the first response byte stands for the engine's `ready`, which the EPP
    does not see)."""

    __slots__ = ("worker", "request_id", "_routing", "_metrics", "_queue", "ended")

    def __init__(self, worker: WorkerState, request_id: str, routing: RouteInputs, metrics: GatewayMetrics,
                 queue: QueueBooking | None):
        self.worker = worker
        self.request_id = request_id
        self._routing = routing
        self._metrics = metrics
        self._queue = queue
        self.ended = False
        worker.inflight += 1
        metrics.inflight.inc()

    async def book(self) -> None:
        queue = self._queue
        if queue is None:
            return
        amount = queue.amount()
        assert amount is not None
        await self._routing.inflight.reserve(self.worker.worker_id, self.request_id, amount)
        if self.worker.upstream.reports_queue:  # a report probed from now on counts the request
            registry = self._routing.registry
            registry.after_report(self.worker, registry.loop_lag.now(), self._reported)

    async def _reported(self) -> None:
        if self._queue is not None:
            self._queue.reported = True
            await self._rebook()

    async def _rebook(self) -> None:
        queue = self._queue
        if queue is None or queue.released:
            return
        amount = queue.amount()
        if amount is None:
            queue.released = True
            await self._routing.inflight.release(self.worker.worker_id, self.request_id)
        else:
            await self._routing.inflight.reserve(self.worker.worker_id, self.request_id, amount)

    async def started(self) -> None:
        """The response's first bytes: the engine runs the request, its queue no longer holds it."""
        if self._queue is not None and not self._queue.ready:
            self._queue.ready = True
            await self._rebook()

    async def move(self, worker: WorkerState) -> None:
        """The data plane reports that `worker` served (a fallback): the load is its."""
        if worker is self.worker or self.ended:
            return
        if self._queue is not None and not self._queue.released:
            self._queue.released = True
            await self._routing.inflight.release(self.worker.worker_id, self.request_id)
        self.worker.inflight -= 1
        worker.inflight += 1
        self.worker = worker

    def end(self) -> None:
        """Synchronous, so that a cancelled stream's `finally` releases the load for certain; a
        queue booking still held goes in the background."""
        if self.ended:
            return
        self.ended = True
        self.worker.inflight -= 1
        self._metrics.inflight.dec()
        if self._queue is not None and not self._queue.released:
            self._queue.released = True
            run_in_background(self._routing.inflight.release(self.worker.worker_id, self.request_id))


@dataclass(slots=True)
class Pick:
    workers: list[WorkerState]  # preference order; the first is booked
    plan: Plan
    booking: Booking

    @property
    def header(self) -> str:
        return ",".join(endpoint_of(w.url) for w in self.workers)


class EndpointPicker:
    def __init__(self, registry: WorkerRegistry, routing: RouteInputs, metrics: GatewayMetrics, fallbacks: int):
        self.registry = registry
        self.routing = routing
        self.metrics = metrics
        self.fallbacks = fallbacks

    def by_endpoint(self, endpoint: str) -> WorkerState | None:
        """The worker whose URL dials `endpoint` (`ip:port`)."""
        for worker in self.registry.workers.values():
            if endpoint_of(worker.url) == endpoint:
                return worker
        return None

    def ready(self) -> bool:
        """Endpoints are known: at least one unified worker is healthy."""
        return any(w.spec.role == Role.UNIFIED for w in self.registry.healthy())

    async def pick(self, prepared: PreparedRequest | None, subset: frozenset[str] | None, request_id: str,
                   session_key: str | None = None) -> Pick:
        """The endpoints for a request (`prepared`: None when the path carries no generation body);
        NoHealthyWorker (503) when none is eligible, Overloaded (429) when admission sheds it."""
        views = [v for v in await self.routing.views() if v.role == Role.UNIFIED]
        if subset is not None:
            urls = {w.worker_id: w.url for w in self.registry.workers.values()}
            views = [v for v in views if endpoint_of(urls[v.worker_id]) in subset]
        if not views:
            where = "in the subset hint" if subset is not None else "in the pool"
            raise NoHealthyWorker(f"No eligible endpoint {where} can serve this request; retry shortly.")
        hashes: dict[str, list[int]] = {}
        overlap = Overlap()
        prompt_tokens = 0
        if prepared is not None:
            prompt_tokens = prepared.prompt_tokens
            hashes, overlap = await self.routing.overlap(prepared, views)
        plan = self.routing.planner.plan_first(views, prompt_tokens, hashes, overlap, session_key,
                                               fallbacks=self.fallbacks)
        if prepared is not None:
            self.routing.admit(plan, views)
        self.routing.record(plan, request_id)
        chosen = [plan.worker.worker_id, *(w.worker_id for w in plan.fallbacks)]
        workers = [self.registry.workers[w] for w in chosen if w in self.registry.workers]
        if not workers:
            raise NoHealthyWorker("No eligible endpoint can serve this request; retry shortly.")
        queue = QueueBooking(prompt_tokens, plan.decision.predicted_memory_tokens) if prompt_tokens else None
        booking = Booking(workers[0], request_id, self.routing, self.metrics, queue)
        try:
            await booking.book()
        except BaseException:
            booking.end()
            raise
        return Pick(workers, plan, booking)
