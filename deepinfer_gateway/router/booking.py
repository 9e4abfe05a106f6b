"""A request's booking: its load on a worker from the pick to the end of its leg.

One `Booking` per leg, for the gateway's legs (gateway/serving/legs.py), the EPP
(epp/picker.py) and the simulator (simulate/gateway.py, simulate/cluster.py) alike. It holds
two things:

- the worker's in-flight count (`worker.inflight`), from the pick until `end`;
- the request's share of the worker's queue (`amount`, kept in a `Reservations`: this
  process's view or Redis shared across replicas, router/inflight.py; the simulator's
  workers), from the pick until `unqueue` (the first token) or `end`.

Between two load reports every gateway replica sees the same (stale) queues and would pick
the same "best" worker; the routers add all bookings to the reported queue. What a request
books follows what the worker's load reports already say of it, so that the sum "reported
queue + bookings" is the prefill work the worker has ahead (`amount`):
- sent, not yet in a load report: its uncached part (prompt - predicted cached tokens), the
  prefill it will add;
- in a load report, still waiting in the worker's queue: minus its predicted cached tokens,
  since engines report a waiting request's whole prompt (docs/worker-protocol.md) though
  they will compute only its uncached part;
- in a load report and scheduled (`ready`): nothing, the report counts its remaining prefill.

Booking the whole prompt until the first token counted a follow-up turn's cached prefix up
to twice (in the reservation and in the report): the workers holding conversations looked
busier than they were, and the router left them for shorter-looking queues.

A booked request's uncached part is also listed on the worker, for the estimated_ttft policy's
lockstep pricing (router/policies.py): in `admitting` until the worker schedules it (`ready`):
the requests that will share its next step; then in `prefilling`, with the time it was
scheduled (the planner's clock: time.monotonic live, virtual in the simulator), until its first
token: the step under way. Per process, as `worker.inflight` is.

Pure: the I/O is the `Reservations`' (writes queued there, never awaited here), so the
lifecycle is the same under the event loop and in the simulator's virtual time.
"""

from __future__ import annotations

from typing import Any, Generic, Protocol, TypeVar


def amount(prompt: int, cached: int, *, reported: bool, ready: bool) -> int | None:
    """Tokens a request adds to its worker's reported queue (module doc); None: nothing (release).
    `cached` is at most `prompt`."""
    if not reported:
        return prompt - cached
    return None if ready else -cached


class Reservations(Protocol):
    """Where bookings' amounts are kept, by worker id and request id."""

    def reserve(self, worker: str, request_id: str, tokens: int) -> None:
        """Book `tokens` for the request (replacing what it had booked)."""

    def release(self, worker: str, request_id: str) -> None:
        """Nothing booked for the request any more."""


class Counted(Protocol):
    """A worker whose open legs are counted (the routers' view of its running requests)."""

    @property
    def worker_id(self) -> str: ...

    inflight: int
    admitting: dict[str, int]  # request id -> uncached tokens, sent and not yet scheduled (module doc)
    prefilling: dict[str, tuple[int, float]]  # the same, scheduled and no first token yet: (tokens, when scheduled)


W = TypeVar("W", bound=Counted)


def scheduled_since(worker: Counted) -> float:
    """When the last of the worker's `prefilling` requests was scheduled (0: none)."""
    return max(at for _, at in worker.prefilling.values()) if worker.prefilling else 0.0


def crowd_fields(worker: Counted) -> dict[str, Any]:
    """The `WorkerView` fields of the worker's admitting and prefilling requests (router/worker_view.py);
    none when it has neither, their defaults: a view is built per worker per request."""
    admitting, prefilling = worker.admitting, worker.prefilling
    if not admitting and not prefilling:
        return {}
    return {"admitting": len(admitting), "admitting_tokens": sum(admitting.values()),
            "admitting_max": max(admitting.values(), default=0),
            "prefilling_max": max((tokens for tokens, _ in prefilling.values()), default=0),
            "prefilling_since": scheduled_since(worker)}


class Booking(Generic[W]):
    """One leg's load on `worker` (module doc). Taken at the pick: the leg is counted and, with a
    prompt, its amount reserved; each later call is idempotent."""

    __slots__ = ("_reservations", "cached", "ended", "prompt", "queued", "ready", "reported", "request_id",
                 "worker")

    def __init__(self, reservations: Reservations, worker: W, request_id: str, prompt: int = 0,
                 cached: int = 0) -> None:
        self._reservations = reservations
        self.worker = worker
        self.request_id = request_id
        self.prompt = prompt
        self.cached = min(cached, prompt)
        self.reported = False  # a load report taken after the worker accepted it has arrived
        self.ready = False  # the worker scheduled it (its `ready` event)
        self.queued = prompt > 0  # an amount is reserved
        self.ended = False
        worker.inflight += 1
        if self.queued:
            reservations.reserve(worker.worker_id, request_id, self.prompt - self.cached)
            worker.admitting[request_id] = self.prompt - self.cached

    def amount(self) -> int | None:
        return amount(self.prompt, self.cached, reported=self.reported, ready=self.ready)

    def on_report(self) -> None:
        """A load report taken after the worker accepted the request is in: it counts the request."""
        if not self.reported:
            self.reported = True
            self._rebook()

    def on_ready(self, now: float) -> None:
        """The worker scheduled the request at `now` (its `ready`; the EPP: the response's first bytes)."""
        if not self.ready:
            self.ready = True
            tokens = self.worker.admitting.pop(self.request_id, None)
            if tokens is not None:
                self.worker.prefilling[self.request_id] = (tokens, now)
            self._rebook()

    def unqueue(self) -> None:
        """Its first token (or a failure before it): nothing in the worker's queue any more."""
        self.worker.admitting.pop(self.request_id, None)
        self.worker.prefilling.pop(self.request_id, None)
        self._release()

    def _release(self) -> None:
        """Nothing reserved any more (the step lists keep the request until its first token)."""
        if self.queued:
            self.queued = False
            self._reservations.release(self.worker.worker_id, self.request_id)

    def move(self, worker: W) -> None:
        """Another worker serves the leg (the data plane's fallback): the count is its, the
        reservation on the first one goes."""
        if worker is self.worker or self.ended:
            return
        self.unqueue()
        self.worker.inflight -= 1
        worker.inflight += 1
        self.worker = worker

    def end(self) -> None:
        """The leg is over: the count and any reservation still held are released."""
        if self.ended:
            return
        self.ended = True
        self.unqueue()
        self.worker.inflight -= 1

    def _rebook(self) -> None:
        """The booking after a change of what the worker's reports say of the request."""
        if not self.queued:  # first token, end or failure: gone already
            return
        tokens = self.amount()
        if tokens is None:  # the report counts what is left of its prefill; it is still in the step
            self._release()
        else:
            self._reservations.reserve(self.worker.worker_id, self.request_id, tokens)
