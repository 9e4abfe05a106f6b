"""Simulated workers: the sim engine's `SchedulerCore` plus what the gateway knows of it.

Each `SimWorker` holds the same scheduler the real-time sim worker runs (workers/sim/
core.py) with its own `SimKvEventLog`, and the gateway-side state the live gateway keeps
per worker (gateway/fleet/registry.py, gateway/serving/route_inputs.py): the last load report, the
in-flight bookings and open legs, and the KV event feed cursor. `view()` builds the
same `WorkerView` the live gateway's `route_inputs.worker_view` builds:

    queued_prefill_tokens = last load report's queued prefill + in-flight bookings (at least 0;
                            router/booking.py `Booking`: what the report does not yet say)
    running               = last load report's running + this gateway's open legs
    dp_ranks              = DP ranks in the last load report
"""

from __future__ import annotations

from dataclasses import replace

from deepinfer_gateway.core.protocol import Role
from deepinfer_gateway.router.booking import Booking, crowd_fields
from deepinfer_gateway.router.planner import WorkerView
from deepinfer_gateway.simulate.config import ClusterConfig
from deepinfer_gateway.simulate.cruise import CruisingCore
from deepinfer_gateway.workers.sim.core import RequestUpdate
from deepinfer_gateway.workers.sim.kv_events import SimKvEventLog
from deepinfer_gateway.workers.sim.kv_store import InMemoryKvStore
from deepinfer_gateway.workers.sim.profiles import HardwareProfile, load_profiles


class SimWorker:
    __slots__ = (
        "_view",
        "admitting",
        "prefilling",
        "booked",
        "busy",
        "core",
        "cruise",
        "cursor",
        "events",
        "inflight",
        "model",
        "pending",
        "pool",
        "profile",
        "report_queued",
        "report_ranks",
        "report_running",
        "reserved",
        "unreported",
        "role",
        "stale",
        "version",
        "worker_id",
    )

    def __init__(self, worker_id: str, role: Role, pool: str, profile: HardwareProfile, model: str,
                 store: InMemoryKvStore | None, time_scale: float) -> None:
        self.worker_id = worker_id
        self.role = role
        self.pool = pool
        self.profile = profile
        self.model = model
        self.events = SimKvEventLog(worker_id)
        self.core = CruisingCore(profile, self.events, model, store=store, time_scale=time_scale)
        self.report_queued = 0  # the gateway's last load report of this worker
        self.report_running = 0
        self.report_ranks = profile.dp_ranks
        self.reserved = 0  # in-flight bookings' sum (router/booking.py `Booking`)
        self.booked: dict[str, int] = {}  # each booking's amount, by request id
        self.unreported: list[Booking[SimWorker]] = []  # bookings the next load report counts
        self.inflight = 0  # open legs on this worker (bookings)
        self.admitting: dict[str, int] = {}  # of those, sent and not yet scheduled (router/booking.py)
        self.prefilling: dict[str, tuple[int, float]] = {}  # scheduled, no first token yet: (tokens, when)
        self.busy = False  # a step is under way (its end is on the event heap)
        self.pending: list[RequestUpdate] | None = None  # what the step under way produces
        self.cursor = 0  # KV event feed: next `after`
        self.cruise: tuple[float, float, int] | None = None  # steady stretch under way: (start, step s, steps)
        self.version = 0  # invalidates a cruise's end event when an arrival interrupts it
        self._view: WorkerView | None = None
        self.stale: set[SimWorker] = set()  # where a changed view is announced (the simulator's)

    @property
    def kv_format(self) -> str:
        return self.profile.kv_format

    def report(self) -> None:
        """Take a load report now (what the gateway's health check reads): it counts every
        request sent so far (they reach the core at once), as a live report probed after the
        worker accepted them does."""
        self.report_queued, self.report_running = self.core.load_totals()
        self.report_ranks = self.profile.dp_ranks  # len(rank_loads()), which has one per rank
        unreported, self.unreported = self.unreported, []
        for booking in unreported:
            booking.on_report()
        self.changed()

    def book(self, request_id: str, prompt: int = 0, cached: int = 0) -> Booking[SimWorker]:
        """A leg sent here (the live gateway's `Legs._open`): counted, and with a prompt booked
        in the worker's queue until the next load report counts it."""
        booking = Booking(self, self, request_id, prompt, cached)
        if booking.queued:
            self.unreported.append(booking)
        self.changed()
        return booking

    # The worker's own bookings (router/booking.py `Reservations`).

    def reserve(self, worker: str, request_id: str, tokens: int) -> None:
        self.reserved += tokens - self.booked.get(request_id, 0)
        self.booked[request_id] = tokens
        self.changed()

    def release(self, worker: str, request_id: str) -> None:
        tokens = self.booked.pop(request_id, None)
        if tokens is not None:
            self.reserved -= tokens
            self.changed()

    def changed(self) -> None:
        self._view = None
        self.stale.add(self)

    def view(self) -> WorkerView:
        view = self._view
        if view is None:
            view = self._view = WorkerView(
                worker_id=self.worker_id, role=self.role, pool=self.pool, hardware=str(self.profile.hardware),
                kv_format=self.profile.kv_format, model=self.model,
                queued_prefill_tokens=max(0, self.report_queued + self.reserved), booked_tokens=self.reserved,
                running=self.report_running + self.inflight, dp_ranks=self.report_ranks,
                **crowd_fields(self),
                slots=self.profile.max_num_seqs * self.report_ranks,
                preempts=self.profile.scheduling_policy == "priority",
            )
        return view


def build_workers(config: ClusterConfig) -> tuple[list[SimWorker], InMemoryKvStore | None]:
    profiles = load_profiles(config.profiles or None)
    store = InMemoryKvStore(capacity_blocks=config.store.capacity_blocks) if config.store.enabled else None
    workers: list[SimWorker] = []
    counters: dict[str, int] = {}
    for group in config.workers:
        if group.hardware not in profiles:
            raise ValueError(f"workers: no hardware profile {group.hardware!r} (have {', '.join(sorted(profiles))})")
        profile = profiles[group.hardware]
        if group.memory_capacity_blocks is not None:
            profile = replace(profile, memory_capacity_blocks=group.memory_capacity_blocks)
        if config.store.read_bytes_per_s is not None:
            profile = replace(profile, store_read_bytes_per_s=config.store.read_bytes_per_s)
        pool = group.pool or str(group.role)
        for _ in range(group.count):
            key = f"{pool}-{group.hardware}"
            n = counters[key] = counters.get(key, -1) + 1
            workers.append(SimWorker(f"{key}-{n}", group.role, pool, profile, config.model, store,
                                     config.time_scale))
    return workers, store
