"""The gateway's side of a simulated request: routing on arrival and at the hand-off.

Mirrors the live request path: on arrival, views (load report + bookings, as
`RouteInputs.views` in gateway/serving/route_inputs.py), hashes per KV format, one index lookup,
`plan_first`, admission control, then `add_request` on the chosen worker with the leg's
role (`pd` -> prefill, stop after the first token; `unified`/`bypass` -> unified),
booking the request on its worker (router/booking.py `Booking`: the open leg, and the
prompt in the worker's queue until the first token comes back). At a prefill's hand-off:
`plan_decode` on fresh views, and the decode worker gets prompt + first token with the KV
load cost the sim engine's `_decode_request` charges (store read bandwidth when there is a
store, else the direct transfer bandwidth). `SimGateway` also holds the requests in flight.

A session round (`session_of`, filled by sessions.py) is planned with its session key and its
parent (lineage), as the live gateway's; with `session_capacity` on, the policy of
router/session_capacity.py decides before flow control and planning, as `SessionGate` does:
a round that waits is held until `pump` starts it (one cached nowhere on whichever worker of
its pool has room first, planned there); its round ends (`finished`) when it is answered or
fails.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from deepinfer_gateway.core.protocol import KV_BLOCK_TOKENS, FinishReason
from deepinfer_gateway.core.session_identity import SessionIdentity
from deepinfer_gateway.kvcache.factory import create_prefix_index
from deepinfer_gateway.kvcache.hashing import PrefixHasher, pack_tokens
from deepinfer_gateway.kvcache.memory import InMemoryPrefixIndex
from deepinfer_gateway.kvcache.routed import RoutedPrefixes
from deepinfer_gateway.kvcache.types import Overlap
from deepinfer_gateway.router.admission import pool_queued_tokens, retry_after
from deepinfer_gateway.router.booking import Booking
from deepinfer_gateway.router.flow import FlowLimits, FlowPolicy, FlowRequest, Holds, PoolLoad, Tier
from deepinfer_gateway.router.planner import Mode, NoCandidate, Plan, RoutePlanner, prompt_hashes
from deepinfer_gateway.router.policy import Lineage
from deepinfer_gateway.router.session_capacity import (
    CapacityLimits,
    SessionCapacity,
    Start,
    Verdict,
    Waiter,
    blocks_of,
)
from deepinfer_gateway.simulate.cluster import SimWorker
from deepinfer_gateway.simulate.config import ClusterConfig
from deepinfer_gateway.simulate.stats import SimStats
from deepinfer_gateway.simulate.tokens import PromptIds, PromptTokens
from deepinfer_gateway.simulate.views import ViewList
from deepinfer_gateway.workers.sim.core import AdmissionError, SimRequest
from deepinfer_gateway.workers.sim.kv_store import InMemoryKvStore
from deepinfer_gateway.workers.sim.step_model import kv_load_seconds
from deepinfer_gateway.workload.types import RecordError, RequestRecord, TraceRequest


@dataclass(slots=True)
class RequestState:
    """A request in flight: its trace entry, the record being filled, and its current leg."""

    trace: TraceRequest
    record: RequestRecord
    tokens: PromptIds | list[int]  # a trace request's built only where read; a session round's given
    output: list[int]
    hashes: dict[str, list[int]] = field(default_factory=dict)
    plan: Plan | None = None
    worker: SimWorker | None = None  # the current leg's worker
    booking: Booking[SimWorker] | None = None  # the current leg's
    last_token_t: float = -1.0
    emitted: int = 0
    flow_pool: str | None = None  # flow control: the pool it counts as starting in, until its first token
    slot_pool: str | None = None  # flow control: the pool where it holds a sequence slot, until its end
    slot_tier: Tier = Tier.DEFAULT  # ... at this tier (router/flow.py Holds)
    session: SessionIdentity | None = None  # a session round's
    avoid: frozenset[str] = frozenset()  # session capacity: workers without room for its session
    session_begun: bool = False  # session capacity counts it as its session's round in flight

SIM_HASHER_BYTES = 256 << 20


def _held(request: FlowRequest) -> RequestState:
    """The simulated request a flow-control entry holds."""
    assert isinstance(request.handle, RequestState)
    return request.handle


class SimGateway:
    def __init__(self, config: ClusterConfig, workers: list[SimWorker], store: InMemoryKvStore | None,
                 prompts: PromptTokens, stats: SimStats, clock: Callable[[], float]) -> None:
        self.config = config
        self.store = store
        self.prompts = prompts
        self.stats = stats
        # As the gateway's (a follow-up turn digests only its new blocks), with room for a
        # whole trace's conversations: memory matters less here than in a serving process.
        self.hasher = PrefixHasher(max_bytes=SIM_HASHER_BYTES)
        self.by_id = {w.worker_id: w for w in workers}
        # Every worker's view, rebuilt only for the workers whose view changed.
        self._views = ViewList(w.view() for w in workers)
        self._position = {w: i for i, w in enumerate(workers)}
        self._stale: set[SimWorker] = set()
        for w in workers:
            w.stale = self._stale
        self.formats = {w.worker_id: w.kv_format for w in workers}
        self._format_views = list({w.kv_format: w.view() for w in workers}.values())
        self.planner = RoutePlanner(config.router, clock)
        index = create_prefix_index(None, clock=clock)
        assert isinstance(index, InMemoryPrefixIndex)
        self.index = index
        ttl = config.router.routed_prefix_s
        self.routed = RoutedPrefixes(ttl) if ttl > 0 else None  # as the gateway's RouteInputs
        self.requests: dict[str, RequestState] = {}
        self.active = 0  # requests arrived and not finished
        self.on_end: Callable[[RequestState], None] | None = None  # told of every finish and failure
        self.clock = clock
        flow = config.flow_control
        # Flow control as the gateway's (gateway/serving/flow_gate.py), on the virtual clock: held
        # requests wait in `flow`, `pump` starts them as the workers free up.
        self.flow = FlowPolicy(FlowLimits.of(flow)) if flow.enabled else None
        self.holds = Holds(self.flow.limits) if self.flow is not None else None
        self.speeds = {hardware: self.planner.hardware_cost(hardware).prefill_tokens_per_s
                       for hardware in {str(w.profile.hardware) for w in workers}}
        self.session_of: dict[int, SessionIdentity] = {}  # trace index -> its round's session, until it arrives
        capacity = config.session_capacity
        self.sessions = SessionCapacity(CapacityLimits.of(capacity)) if capacity.enabled else None
        self.capacity = {w.worker_id: w.profile.memory_capacity_blocks for w in workers}

    def arrive(self, trace: TraceRequest, record: RequestRecord, tokens: list[int] | None = None) -> SimWorker | None:
        """Route a new request and start its first leg; the worker to kick, None if it failed.
        `tokens`: its prompt ids when given (a session round's), else the trace's synthesis."""
        rid = str(trace.index)
        if tokens is None:
            req = RequestState(trace, record, self.prompts.ids(trace), self.prompts.output(trace))
            packed = self.prompts.packed(trace)
        else:
            req = RequestState(trace, record, tokens, self.prompts.output(trace))
            packed = pack_tokens(tokens)
        req.session = self.session_of.pop(trace.index, None)
        self.requests[rid] = req
        self.active += 1
        record.prompt_tokens = len(req.tokens)
        views = self.current_views()
        # One view per KV format says what the salts need (every view of a format has one model).
        req.hashes = hashes = prompt_hashes(req.tokens, self._format_views, self.hasher, packed)
        overlap = self._lookup(hashes, self.formats)
        if self.sessions is not None and req.session is not None and req.session.session is not None:
            if not self._session_arrive(req, req.session.session, views, overlap):
                return None  # waits for room
        return self._admitted(req, views, hashes, overlap)

    def _lookup(self, hashes: dict[str, list[int]], formats: dict[str, str]) -> Overlap:
        """The index's overlap, with what was just routed (as `RouteInputs.overlap`)."""
        overlap = self.index.lookup_now(hashes, formats)
        return overlap if self.routed is None else self.routed.merged(overlap, hashes, formats, self.clock())

    def _admitted(self, req: RequestState, views: ViewList, hashes: dict[str, list[int]],
                  overlap: Overlap) -> SimWorker | None:
        """Past session capacity: flow control, then the plan; the worker to kick, None if held or failed."""
        if self.flow is not None and not self._flow_arrive(req, views, overlap):
            return None  # held (or refused)
        return self._place(req, views, hashes, overlap)

    def _place(self, req: RequestState, views: ViewList, hashes: dict[str, list[int]],
               overlap: Overlap) -> SimWorker | None:
        """Plan, admit and start the first leg; the worker to kick, None if it failed."""
        rid, record = str(req.trace.index), req.record
        session = req.session
        key = session.session if session is not None else None
        lineage = Lineage(parent_key=session.parent) if session is not None and session.parent is not None else None
        try:
            plan = self.planner.plan_first(views, len(req.tokens), hashes, overlap, key, req.avoid, lineage=lineage)
        except NoCandidate as exc:
            self.fail(req, RecordError.HTTP_5XX, str(exc))
            return None
        if self.sessions is not None and key is not None:
            if req.session_begun:
                self.sessions.move(key, plan.worker.worker_id, self.clock())
            else:
                req.session_begun = True
                self.sessions.begin(key, plan.worker.worker_id, blocks_of(len(req.tokens)), self.clock())
        if not self._admit(plan, views, req):
            return None
        req.plan = plan
        mode = str(plan.mode)
        self.stats.modes[mode] = self.stats.modes.get(mode, 0) + 1
        worker = self.by_id[plan.worker.worker_id]
        record.worker = worker.worker_id
        priority = req.slot_tier.engine_priority if worker.core.by_priority and req.slot_pool is not None else 0
        sim = SimRequest(rid, req.tokens, req.output, FinishReason.LENGTH, stop_after_first=plan.mode is Mode.PD,
                         priority=priority)
        try:
            worker.core.add_request(sim, hashes[worker.kv_format])
        except AdmissionError as exc:
            self.fail(req, RecordError.HTTP_4XX, str(exc))
            return None
        req.worker = worker
        req.booking = worker.book(rid, len(req.tokens), plan.decision.predicted_memory_tokens)
        if self.routed is not None:
            self.routed.add(worker.worker_id, hashes[worker.kv_format], self.clock())
        return worker

    # --- session capacity -----------------------------------------------------------------

    def _session_arrive(self, req: RequestState, session: str, views: ViewList, overlap: Overlap) -> bool:
        """Whether the round goes on now; else it waits in `sessions` for room on a worker."""
        assert self.sessions is not None
        tokens, t = len(req.tokens), self.clock()
        try:
            pool = self.planner.first_pool(views, tokens, overlap)
        except NoCandidate:
            return True  # planning says so
        capacities = {v.worker_id: self.capacity[v.worker_id] for v in views if v.pool == pool}
        memory = overlap.memory
        placement = self.sessions.place(session, blocks_of(tokens), capacities,
                                        {w: memory.get(w, 0) for w in capacities}, t)
        if placement.verdict is Verdict.GO:
            req.avoid = placement.avoid
            return True
        self.sessions.wait(Waiter(session, blocks_of(tokens), placement.worker, t, req,
                                  candidates=placement.candidates))
        self.stats.session_waits += 1
        return False

    def _session_starts(self, t: float) -> list[SimWorker]:
        """The waiting rounds that have room now (or waited their longest), on to flow control and
        their plan; the workers to kick."""
        sessions = self.sessions
        assert sessions is not None
        kicked: list[SimWorker] = []
        for worker in sessions.waiting_workers():  # pinned lines first: they have their workers first
            self._session_started(sessions.starts(worker, self.capacity[worker], t), t, kicked)
        if sessions.floating_workers():
            self._session_started(sessions.starts_floating(self.capacity, t), t, kicked)
        return kicked

    def _session_started(self, starts: list[Start], t: float, kicked: list[SimWorker]) -> None:
        for start in starts:
            req = start.waiter.handle
            assert isinstance(req, RequestState)
            req.session_begun = True
            req.avoid = start.waiter.candidates - {start.worker}  # an unpinned one: planned where it began
            self.stats.session_wait_s += t - start.waiter.arrival
            self.stats.session_proceeded += start.timed_out
            views = self.current_views()
            placed = self._admitted(req, views, req.hashes, self._lookup(req.hashes, self.formats))
            if placed is not None:
                kicked.append(placed)

    def next_session_change(self, t: float) -> float | None:
        """When a waiting round may start with nothing else happening (the simulator wakes then)."""
        return self.sessions.next_change(t) if self.sessions is not None else None

    def finished(self, req: RequestState) -> None:
        """A request answered or failed: its session's round ends; then `on_end`."""
        if req.session_begun and self.sessions is not None and req.session is not None and req.session.session:
            req.session_begun = False
            self.sessions.end(req.session.session, self.clock())
        if req.slot_pool is not None and self.holds is not None:
            self.holds.release(req.slot_pool, req.slot_tier, self.clock())
            req.slot_pool = None
        if self.on_end is not None:
            self.on_end(req)

    # --- flow control -------------------------------------------------------------------

    def _flow_arrive(self, req: RequestState, views: ViewList, overlap: Overlap) -> bool:
        """Whether the request starts now; else it waits in `flow` or was refused (failed)."""
        assert self.flow is not None
        settings, t = self.config.flow_control, self.clock()
        every = self.config.flex_every
        tier = Tier.FLEX if every and req.trace.index % every == every - 1 else Tier.DEFAULT
        tokens = len(req.tokens)
        request = FlowRequest("flex" if tier is Tier.FLEX else "trace", tier, tokens,
                              tokens + min(req.trace.output_length, settings.expected_output_tokens), t,
                              t + settings.ttft_target_s(tier.label), handle=req)
        try:
            pool = self.planner.first_pool(views, tokens, overlap)
        except NoCandidate as exc:
            self.fail(req, RecordError.HTTP_5XX, str(exc))
            return False
        queue = self.flow.pool(pool)
        arrival = queue.arrive(request, self._load(views, pool), t)
        for displaced in arrival.displaced:
            self.fail(_held(displaced), RecordError.RATE_LIMITED, f"pool {pool}: displaced by a higher tier")
        if arrival.shed is not None:
            self.fail(req, RecordError.RATE_LIMITED, f"pool {pool}: flow control ({arrival.shed.reason})")
            return False
        if arrival.start:
            self._starting(req, pool, tier)
        return arrival.start

    def _load(self, views: ViewList, pool: str) -> PoolLoad:
        assert self.holds is not None
        return self.holds.load(views, pool, self.speeds, self.clock())

    def _starting(self, req: RequestState, pool: str, tier: Tier) -> None:
        assert self.holds is not None
        req.flow_pool = req.slot_pool = pool
        req.slot_tier = tier
        self.holds.take(pool, tier, self.clock())

    def started(self, req: RequestState) -> None:
        """Its first token (or its end): it no longer counts as starting in its pool."""
        if req.flow_pool is not None and self.holds is not None:
            self.holds.started(req.flow_pool, req.slot_tier)
            req.flow_pool = None

    def pump(self, t: float) -> list[SimWorker]:
        """Start the session rounds that have room now; refuse the held requests past their
        deadline, start those their pools can take now; the workers to kick."""
        kicked = self._session_starts(t) if self.sessions is not None else []
        if self.flow is None or not self.flow.waiting_pools():
            return kicked
        for pool in self.flow.waiting_pools():
            for late in self.flow.pool(pool).expired(t):
                self.fail(_held(late), RecordError.RATE_LIMITED, f"pool {pool}: flow control (deadline)")
            for request in self.flow.starts(pool, self._load(self.current_views(), pool), t):
                req = _held(request)
                self._starting(req, pool, request.tier)
                views = self.current_views()
                worker = self._place(req, views, req.hashes, self._lookup(req.hashes, self.formats))
                if worker is not None:
                    kicked.append(worker)
        return kicked

    def current_views(self) -> ViewList:
        """What `[w.view() for w in workers]` gives: the one list, its changed workers' views
        replaced (which tells the planner where to look). Read it before the next call."""
        views = self._views
        if self._stale:
            position = self._position
            for worker in self._stale:
                views[position[worker]] = worker.view()
            self._stale.clear()
        return views

    def _admit(self, plan: Plan, views: list[Any], req: RequestState) -> bool:
        """The gateway's admission control (`RouteInputs.admit`): 429 over the pool's budget."""
        pool = plan.worker.pool
        if retry_after(views, pool, self.config.router.admission_queued_tokens,
                       lambda hardware: self.planner.hardware_cost(hardware).prefill_tokens_per_s) is None:
            return True
        queued = pool_queued_tokens(views, pool)
        self.fail(req, RecordError.RATE_LIMITED, f"pool {pool} overloaded ({queued} queued tokens)")
        return False

    def hand_off(self, req: RequestState, t: float) -> SimWorker | None:
        """Start the decode leg of a finished prefill; the worker to kick, None if it failed."""
        prefill = req.worker
        assert prefill is not None
        views = self.current_views()
        tokens = req.tokens + req.output[:1]
        try:
            view, _ = self.planner.plan_decode(views, prefill.kv_format, len(tokens))
        except NoCandidate as exc:
            self.fail(req, RecordError.STREAM, str(exc))
            return None
        worker = self.by_id[view.worker_id]
        profile = worker.profile
        hashes = req.hashes[prefill.kv_format]
        if len(tokens) // KV_BLOCK_TOKENS > len(hashes):
            hashes = worker.core.hashes(tokens, hashes)
        # As SimEngine._decode_request: KV from the store at its read bandwidth, else direct transfer.
        if self.store is not None:
            handed = req.hashes[prefill.kv_format]
            # The store's TTLs share the virtual clock.
            if self.store.match(handed, t) < len(handed):
                self.fail(req, RecordError.STREAM, "handed-off KV is no longer in the store")
                return None
            bandwidth = profile.store_read_bytes_per_s
        else:
            bandwidth = profile.transfer_bytes_per_s
        sim = SimRequest(str(req.trace.index), tokens, req.output[1:], FinishReason.LENGTH,
                         kv_loaded_seconds=kv_load_seconds(profile, len(req.tokens), bandwidth))
        try:
            worker.core.add_request(sim, hashes)
        except AdmissionError as exc:
            self.fail(req, RecordError.STREAM, str(exc))
            return None
        req.worker = worker
        req.booking = worker.book(str(req.trace.index))
        return worker

    def fail(self, req: RequestState, kind: str, detail: str) -> None:
        self.started(req)
        req.record.status, req.record.error, req.record.detail = "error", kind, detail[:200]
        req.record.ttft_s = req.record.e2e_s = None
        self.requests.pop(str(req.trace.index), None)
        self.active -= 1
        self.finished(req)
