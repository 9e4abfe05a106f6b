"""The discrete-event loop: the live gateway's request path in virtual time.

What runs is the live code: `RoutePlanner.plan_first` / `plan_decode` (router/planner.py
and its policies), `prompt_hashes` and the in-memory prefix index (kvcache/), and the sim
engine's `SchedulerCore` per worker (workers/sim/core.py). What the simulator adds is
only the glue the gateway and the real-time engine provide, mirrored:

- arrival (+ the configured gateway overhead): views (load report + reservations, as
  `RouteInputs.views` in gateway/route_inputs.py), hashes per KV format, one index lookup, `plan_first`, then
  `add_request` on the chosen worker with the leg's role (`pd` -> prefill, stop after
  the first token; `unified`/`bypass` -> unified), reserving the prompt tokens until the
  first token comes back;
- a worker with work steps back to back (`SchedulerCore.step`); a step's tokens are
  delivered when its duration has passed, as the real-time engine sleeps then delivers;
- prefill finished with a hand-off (+ handoff overhead): `plan_decode` on fresh views,
  and the decode worker gets prompt + first token with the KV load cost the sim engine's
  `_decode_request` charges (store read bandwidth when there is a store, else the
  direct transfer bandwidth);
- every `load_report_interval_s`: load reports of the workers that changed (the
  gateway's health checks); every `kv_events_interval_s`: each changed worker's KV events
  into the index (`apply`, from the cursor, as `KvEventFeeder`).

Events: one heap of (time, seq, kind, payload); seq keeps FIFO order among equal times.
A step's end is pushed only while its worker has work; ticks touch only the workers that
changed since the last tick, so idle workers cost nothing. An event per step per busy
worker is the bulk of the work (~15 us of `SchedulerCore.step` plus ~5 us of glue).
"""

from __future__ import annotations

import bisect
import gc
import heapq
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from deepinfer_gateway.kvcache.factory import create_prefix_index
from deepinfer_gateway.kvcache.hashing import PrefixHasher
from deepinfer_gateway.kvcache.memory import InMemoryPrefixIndex
from deepinfer_gateway.protocol import KV_BLOCK_TOKENS, FinishReason
from deepinfer_gateway.router.planner import (
    NoCandidate,
    Plan,
    RoutePlanner,
    prompt_hashes,
)
from deepinfer_gateway.simulate.cluster import SimWorker, build_workers
from deepinfer_gateway.simulate.config import ClusterConfig
from deepinfer_gateway.simulate.tokens import PromptTokens
from deepinfer_gateway.workers.sim.core import AdmissionError, RequestUpdate, SimRequest
from deepinfer_gateway.workers.sim.step_model import kv_load_seconds
from deepinfer_gateway.workload.summary import TierTokens
from deepinfer_gateway.workload.types import RecordError, RequestRecord, TraceRequest

_ARRIVE, _STEP, _HANDOFF, _LOAD, _FEED, _CRUISE = range(6)
CRUISE_MIN_STEPS = 4  # shorter steady stretches are stepped one by one
_LEG_ROLE = {"unified": False, "pd": True, "bypass": False}  # stop after the first token?


@dataclass(slots=True)
class _Request:
    trace: TraceRequest
    record: RequestRecord
    tokens: list[int]
    output: list[int]
    hashes: dict[str, list[int]] = field(default_factory=dict)
    plan: Plan | None = None
    worker: SimWorker | None = None  # the current leg's worker
    last_token_t: float = -1.0
    emitted: int = 0


@dataclass
class SimStats:
    heap_events: int = 0  # events popped from the heap (a steady stretch of steps is one)
    steps: int = 0  # engine steps simulated, singly or in steady stretches
    wall_s: float = 0.0  # real seconds the loop took
    sim_s: float = 0.0  # virtual seconds simulated
    memory_tokens: int = 0
    store_tokens: int = 0
    prompt_tokens: int = 0
    modes: dict[str, int] = field(default_factory=dict)

    other_events: int = 0  # arrivals, hand-offs, load-report and KV-feed ticks

    @property
    def events(self) -> int:
        """Discrete events simulated: every engine step, arrival, hand-off and tick."""
        return self.steps + self.other_events

    @property
    def events_per_s(self) -> float:
        return self.events / self.wall_s if self.wall_s else 0.0

    def tiers(self) -> TierTokens:
        return TierTokens(memory=self.memory_tokens, store=self.store_tokens, prompt=self.prompt_tokens)


class Simulator:
    def __init__(self, config: ClusterConfig, *, speedup: float = 1.0, block_size: int = 512,
                 header_offset: bool = True) -> None:
        if speedup <= 0:
            raise ValueError("speedup must be > 0")
        self.config = config
        self.speedup = speedup
        self.now = 0.0
        self.hasher = PrefixHasher()  # as the gateway's: a follow-up turn digests only its new blocks
        self.workers, self.store = build_workers(config)
        self.by_id = {w.worker_id: w for w in self.workers}
        # Every worker's view, rebuilt only for the workers whose view changed.
        self._views = [w.view() for w in self.workers]
        self._position = {w: i for i, w in enumerate(self.workers)}
        self._stale: set[SimWorker] = set()
        for w in self.workers:
            w.stale = self._stale
        self.formats = {w.worker_id: w.kv_format for w in self.workers}
        self.planner = RoutePlanner(config.router)
        index = create_prefix_index(None, clock=lambda: self.now)
        assert isinstance(index, InMemoryPrefixIndex)
        self.index = index
        self.prompts = PromptTokens(block_size, header=header_offset)
        self.stats = SimStats()
        self._heap: list[tuple[float, int, int, Any]] = []
        self._seq = 0
        self._requests: dict[str, _Request] = {}
        self._dirty_load: set[SimWorker] = set()
        self._dirty_feed: set[SimWorker] = set(self.workers)
        self._active = 0  # requests arrived and not finished
        # The gateway's preparation busy periods (serial, relay_waits): [start, end) each.
        self._busy_starts: list[float] = []
        self._busy_ends: list[float] = []

    # --- the loop ---------------------------------------------------------------------

    def _push(self, t: float, kind: int, payload: Any) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, kind, payload))

    def run(self, requests: Sequence[TraceRequest],
            progress: Callable[[int, int], None] | None = None) -> list[RequestRecord]:
        ordered = sorted(requests, key=lambda r: r.arrival_s)
        records = [RequestRecord(index=r.index, arrival_s=r.arrival_s / self.speedup, send_lag_s=0.0,
                                 expected_input_tokens=r.input_length, expected_output_tokens=r.output_length)
                   for r in ordered]
        pending = len(ordered)
        started = time.perf_counter()
        for pair, at in zip(zip(ordered, records, strict=True), self._route_times(ordered, records), strict=True):
            self._push(at, _ARRIVE, pair)
        self._push(0.0, _LOAD, None)
        self._push(0.0, _FEED, None)
        # The loop makes no reference cycles, but allocates ~1,000 routing candidates per
        # request next to millions of long-lived objects (records, token gaps): the cyclic
        # collector's passes cost a third of a fleet-size run. Deferred to after the loop.
        collecting = gc.isenabled()
        gc.disable()
        try:
            events, other = self._loop(pending, len(ordered), progress)
        finally:
            if collecting:
                gc.enable()
        self.stats.heap_events += events
        self.stats.other_events += other
        self.stats.wall_s += time.perf_counter() - started
        self.stats.sim_s = self.now
        return sorted(records, key=lambda r: r.index)

    def _loop(self, pending: int, total: int, progress: Callable[[int, int], None] | None) -> tuple[int, int]:
        """Run the events; (events popped, arrivals + hand-offs + ticks)."""
        heap, pop = self._heap, heapq.heappop
        events = other = done = 0
        load_every = self.config.load_report_interval_s
        feed_every = self.config.kv_events_interval_s
        while heap:
            t, _, kind, payload = pop(heap)
            self.now = t
            events += 1
            if kind == _STEP:
                self._step_done(payload, t)
            elif kind == _ARRIVE:
                other += 1
                pending -= 1
                request, record = payload
                self._arrive(request, record, t)
                if progress is not None:
                    done += 1
                    progress(done, total)
            elif kind == _CRUISE:
                worker, version = payload
                if version == worker.version:
                    self._cruise_done(worker, t)
            elif kind == _HANDOFF:
                other += 1
                self._hand_off(payload, t)
            elif kind == _FEED:
                other += 1
                self._feed()
                if pending or self._active:
                    self._push(t + feed_every, _FEED, None)
            else:
                other += 1
                self._load_tick()
                if pending or self._active:
                    self._push(t + load_every, _LOAD, None)
        return events, other

    def _route_times(self, requests: Sequence[TraceRequest], records: Sequence[RequestRecord]) -> list[float]:
        """When each request is routed: arrival + the gateway's preparation cost (config.GatewayCost),
        queued behind the previous request's in its lane when the gateway is serial: the event
        loop's, or, for prompts of `offload_tokens` or more, the preparation thread's. Records
        the busy periods of the loop lane (for `relay_waits`)."""
        gw = self.config.gateway
        extra = len(self.prompts.header) + len(self.prompts.trailer)
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

    def _relayed(self, t: float) -> float:
        """When a token the engine produced at t reaches the client: at the end of the gateway's
        event-loop preparation busy period that t falls in, if any (`GatewayCost.relay_waits`)."""
        i = bisect.bisect_right(self._busy_starts, t) - 1
        if i >= 0 and t < self._busy_ends[i]:
            return self._busy_ends[i]
        return t

    # --- gateway side -------------------------------------------------------------------

    def _arrive(self, trace: TraceRequest, record: RequestRecord, t: float) -> None:
        rid = str(trace.index)
        req = _Request(trace, record, self.prompts.prompt(trace), self.prompts.output(trace))
        self._requests[rid] = req
        self._active += 1
        record.prompt_tokens = len(req.tokens)
        views = self._current_views()
        req.hashes = hashes = prompt_hashes(req.tokens, views, self.hasher)
        overlap = self.index.lookup_now(hashes, self.formats)
        try:
            plan = self.planner.plan_first(views, len(req.tokens), hashes, overlap)
        except NoCandidate as exc:
            self._fail(req, RecordError.HTTP_5XX, str(exc))
            return
        if not self._admit(plan, views, req):
            return
        req.plan = plan
        self.stats.modes[plan.mode] = self.stats.modes.get(plan.mode, 0) + 1
        worker = self.by_id[plan.worker.worker_id]
        record.worker = worker.worker_id
        sim = SimRequest(rid, req.tokens, req.output, FinishReason.LENGTH, stop_after_first=_LEG_ROLE[plan.mode])
        try:
            worker.core.add_request(sim, hashes[worker.kv_format])
        except AdmissionError as exc:
            self._fail(req, RecordError.HTTP_4XX, str(exc))
            return
        req.worker = worker
        worker.inflight += 1
        worker.reserved += len(req.tokens)
        worker.changed()
        self._kick(worker, t)

    def _current_views(self) -> list[Any]:
        """What `[w.view() for w in self.workers]` gives, from the last list and the changed workers."""
        views = self._views
        if self._stale:
            position = self._position
            for worker in self._stale:
                views[position[worker]] = worker.view()
            self._stale.clear()
        return list(views)

    def _admit(self, plan: Plan, views: list[Any], req: _Request) -> bool:
        """The gateway's admission control (`RouteInputs.admit`): 429 over the pool's budget."""
        budget = self.config.router.admission_queued_tokens
        if not budget:
            return True
        queued = sum(v.queued_prefill_tokens for v in views if v.pool == plan.worker.pool)
        if queued <= budget:
            return True
        self._fail(req, RecordError.RATE_LIMITED, f"pool {plan.worker.pool} overloaded ({queued} queued tokens)")
        return False

    def _hand_off(self, req: _Request, t: float) -> None:
        prefill = req.worker
        assert prefill is not None
        views = self._current_views()
        tokens = req.tokens + req.output[:1]
        try:
            view, _ = self.planner.plan_decode(views, prefill.kv_format, len(tokens))
        except NoCandidate as exc:
            self._fail(req, RecordError.STREAM, str(exc))
            return
        worker = self.by_id[view.worker_id]
        profile = worker.profile
        hashes = req.hashes[prefill.kv_format]
        if len(tokens) // KV_BLOCK_TOKENS > len(hashes):
            hashes = worker.core.hashes(tokens)
        # As SimEngine._decode_request: KV from the store at its read bandwidth, else direct transfer.
        if self.store is not None:
            handed = req.hashes[prefill.kv_format]
            if self.store.match(handed, self._unix(t)) < len(handed):
                self._fail(req, RecordError.STREAM, "handed-off KV is no longer in the store")
                return
            bandwidth = profile.store_read_bytes_per_s
        else:
            bandwidth = profile.transfer_bytes_per_s
        sim = SimRequest(str(req.trace.index), tokens, req.output[1:], FinishReason.LENGTH,
                         kv_loaded_seconds=kv_load_seconds(profile, len(req.tokens), bandwidth))
        try:
            worker.core.add_request(sim, hashes)
        except AdmissionError as exc:
            self._fail(req, RecordError.STREAM, str(exc))
            return
        req.worker = worker
        worker.inflight += 1
        worker.changed()
        self._kick(worker, t)

    def _fail(self, req: _Request, kind: str, detail: str) -> None:
        req.record.status, req.record.error, req.record.detail = "error", kind, detail[:200]
        req.record.ttft_s = req.record.e2e_s = None
        self._requests.pop(str(req.trace.index), None)
        self._active -= 1

    # --- engine side --------------------------------------------------------------------

    def _unix(self, t: float) -> float:
        return t  # the store's TTLs and the index's expiry share the virtual clock

    def _kick(self, worker: SimWorker, t: float) -> None:
        self._dirty_load.add(worker)
        self._dirty_feed.add(worker)
        if worker.cruise is not None:  # the new request joins at the end of the step under way
            start, seconds, steps = worker.cruise
            done = min(steps, int((t - start) / seconds) + 1)
            self._materialize(worker, start, seconds, done)
            worker.pending = None
            self._push(start + done * seconds, _STEP, worker)
        elif not worker.busy:
            worker.busy = True
            self._start_step(worker, t)

    def _start_step(self, worker: SimWorker, t: float) -> None:
        steady = worker.core.steady()
        if steady is not None and steady[1] > CRUISE_MIN_STEPS:
            seconds, steps = steady[0], steady[1] - 1
            worker.cruise = (t, seconds, steps)
            self._push(t + steps * seconds, _CRUISE, (worker, worker.version))
            return
        duration, updates = worker.core.step(self._unix(t))
        self.stats.steps += 1
        worker.pending = updates
        if duration <= 0.0:
            duration = 1e-9  # nothing could run (cannot happen with a consistent core); keep time moving
        self._push(t + duration, _STEP, worker)

    def _step_done(self, worker: SimWorker, t: float) -> None:
        updates = worker.pending
        worker.pending = None
        if updates:
            for update in updates:
                self._deliver(worker, update, t)
        self._dirty_load.add(worker)
        self._dirty_feed.add(worker)
        if worker.core.has_work():
            self._start_step(worker, t)
        else:
            worker.busy = False

    def _cruise_done(self, worker: SimWorker, t: float) -> None:
        assert worker.cruise is not None
        start, seconds, steps = worker.cruise
        self._materialize(worker, start, seconds, steps)
        self._start_step(worker, t)

    def _materialize(self, worker: SimWorker, start: float, seconds: float, steps: int) -> None:
        """Apply `steps` steps of a steady stretch: tokens, one chunk per step (no ready, no finish)."""
        worker.cruise = None
        worker.version += 1
        self.stats.steps += steps
        end = start + steps * seconds
        for rid, tokens in worker.core.cruise(steps):
            req = self._requests[rid]
            req.record.itl_s.append(start + seconds - req.last_token_t)
            req.record.itl_s.extend([seconds] * (steps - 1))
            req.last_token_t = end
            req.emitted += len(tokens)

    def _deliver(self, worker: SimWorker, update: RequestUpdate, t: float) -> None:
        req = self._requests.get(update.request_id)
        if req is None:
            return
        record = req.record
        if update.ready is not None and req.emitted == 0:  # the first leg's ready: cached tokens
            mem, store = update.ready
            record.cached_tokens = mem + store
            self.stats.memory_tokens += mem
            self.stats.store_tokens += store
            self.stats.prompt_tokens += record.prompt_tokens or 0
        if update.token_ids:
            if req.emitted == 0:
                record.ttft_s = self._relayed(t) - record.arrival_s
                worker.reserved -= len(req.tokens)  # the first token releases the reservation
                worker.changed()
            else:
                record.itl_s.append(t - req.last_token_t)
            req.last_token_t = t
            req.emitted += len(update.token_ids)
        if update.finish is None:
            return
        worker.inflight -= 1
        worker.changed()
        if update.handoff and req.plan is not None and req.plan.mode == "pd":
            self._push(t + self.config.gateway.handoff_overhead_s, _HANDOFF, req)
            return
        record.e2e_s = t - record.arrival_s
        record.output_tokens = req.emitted
        del self._requests[update.request_id]
        self._active -= 1

    # --- ticks --------------------------------------------------------------------------

    def _load_tick(self) -> None:
        for worker in self._dirty_load:
            worker.report()
        self._dirty_load = {w for w in self._dirty_load if w.busy}

    def _feed(self) -> None:
        limit = self.config.kv_events_limit
        apply = self.index.apply_now
        for worker in self._dirty_feed:
            events = worker.events
            while worker.cursor < events.last_seq:
                batch = events.batch(worker.cursor, limit)
                worker.cursor = apply(worker.worker_id, batch)
                if not batch.events:
                    break
        self._dirty_feed = {w for w in self._dirty_feed if w.busy}
