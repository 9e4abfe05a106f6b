"""The discrete-event loop: the live gateway's request path in virtual time.

What runs is the live code: `RoutePlanner.plan_first` / `plan_decode` (router/planner.py
and its policies), `prompt_hashes` and the in-memory prefix index (kvcache/), and the sim
engine's `SchedulerCore` per worker (workers/sim/core.py). What the simulator adds is
only the glue the gateway and the real-time engine provide, mirrored:

- arrival (+ the gateway's preparation cost, preparation.py): routing and the first leg
  (gateway.py);
- a worker with work steps back to back (`SchedulerCore.step`); a step's tokens are
  delivered when its duration has passed, as the real-time engine sleeps then delivers;
- prefill finished with a hand-off (+ handoff overhead): the decode leg (gateway.py);
- every `load_report_interval_s`: load reports of the workers that changed (the
  gateway's health checks); every `kv_events_interval_s`: each changed worker's KV events
  into the index (`apply`, from the cursor, as `KvEventFeeder`).

Events: one heap of (time, seq, kind, payload); seq keeps FIFO order among equal times.
A step's end is pushed only while its worker has work; ticks touch only the workers that
changed since the last tick, so idle workers cost nothing. An event per step per busy
worker is the bulk of the work (~15 us of `SchedulerCore.step` plus ~5 us of glue).
"""

from __future__ import annotations

import gc
import heapq
import time
from collections.abc import Callable, Sequence
from typing import Any

from deepinfer_gateway.router.planner import Mode
from deepinfer_gateway.simulate.cluster import SimWorker, build_workers
from deepinfer_gateway.simulate.config import ClusterConfig
from deepinfer_gateway.simulate.gateway import SimGateway
from deepinfer_gateway.simulate.preparation import PreparationLanes
from deepinfer_gateway.simulate.stats import SimStats
from deepinfer_gateway.simulate.tokens import PromptTokens
from deepinfer_gateway.workers.sim.core import RequestUpdate
from deepinfer_gateway.workload.types import RequestRecord, TraceRequest

__all__ = ["CRUISE_MIN_STEPS", "SimStats", "Simulator"]

_ARRIVE, _STEP, _HANDOFF, _LOAD, _FEED, _CRUISE, _PREPARE, _SESSIONS = range(8)
CRUISE_MIN_STEPS = 4  # shorter steady stretches are stepped one by one


class Simulator:
    def __init__(self, config: ClusterConfig, *, speedup: float = 1.0, block_size: int = 512,
                 header_offset: bool = True) -> None:
        if speedup <= 0:
            raise ValueError("speedup must be > 0")
        self.config = config
        self.speedup = speedup
        self.now = 0.0
        self.workers, self.store = build_workers(config)
        self.prompts = PromptTokens(block_size, header=header_offset)
        self.stats = SimStats()
        self.gateway = SimGateway(config, self.workers, self.store, self.prompts, self.stats,
                                  clock=lambda: self.now)
        self.preparation = PreparationLanes(config.gateway, len(self.prompts.header) + len(self.prompts.trailer))
        self.index = self.gateway.index  # the KV feed ticks apply worker events into it
        self._requests = self.gateway.requests  # the same dict: the engine side finds requests by id
        self._heap: list[tuple[float, int, int, Any]] = []
        self._seq = 0
        self._dirty_load: set[SimWorker] = set()
        self._dirty_feed: set[SimWorker] = set(self.workers)
        self._pending = 0  # arrivals pushed, not yet routed
        self._session_wake: float | None = None  # session capacity: when a waiting round may start

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
        self._pending = len(ordered)
        route_times = self.preparation.route_times(ordered, records)
        for (request, record), at in zip(zip(ordered, records, strict=True), route_times, strict=True):
            self._push(at, _ARRIVE, (request, record, None))
        self.run_events(len(ordered), progress)
        return sorted(records, key=lambda r: r.index)

    def arrive_at(self, t: float, request: TraceRequest, record: RequestRecord, tokens: list[int]) -> None:
        """A request (a session round) arriving at virtual time t with these prompt ids; it is
        routed after the gateway's preparation, lanes taken in arrival order. Call before
        `run_events` or from an event (`SimGateway.on_end`)."""
        self._pending += 1
        self._push(t, _PREPARE, (request, record, tokens))

    def run_events(self, total: int, progress: Callable[[int, int], None] | None = None) -> None:
        """Run the event loop until nothing is pending or in flight (`total`: for `progress`)."""
        started = time.perf_counter()
        self._push(0.0, _LOAD, None)
        self._push(0.0, _FEED, None)
        # The loop makes no reference cycles but builds millions of long-lived objects (KV
        # event logs, cache entries, records): the cyclic collector's passes over them cost
        # a third of a fleet-size run, so it is off during the loop. Its objects then move to
        # the oldest generation untraversed (freeze, unfreeze): re-enabled as they were, the
        # next young collection would walk all of them once (~1 s at 1,024 workers).
        collecting = gc.isenabled()
        gc.disable()
        try:
            events, other = self._loop(total, progress)
        finally:
            gc.freeze()
            gc.unfreeze()
            if collecting:
                gc.enable()
        self.stats.heap_events += events
        self.stats.other_events += other
        self.stats.wall_s += time.perf_counter() - started
        self.stats.sim_s = self.now

    def _loop(self, total: int, progress: Callable[[int, int], None] | None) -> tuple[int, int]:
        """Run the events; (events popped, arrivals + hand-offs + ticks). `_pending` counts the
        arrivals pushed and not yet routed: ticks go on while it or the requests in flight do."""
        heap, pop = self._heap, heapq.heappop
        gateway = self.gateway
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
                self._pending -= 1
                worker = gateway.arrive(*payload)
                if worker is not None:
                    self._kick(worker, t)
                self._wake_sessions(t)
                if progress is not None:
                    done += 1
                    progress(done, total)
            elif kind == _CRUISE:
                worker, version = payload
                if version == worker.version:
                    self._cruise_done(worker, t)
            elif kind == _HANDOFF:
                other += 1
                worker = gateway.hand_off(payload, t)
                if worker is not None:
                    self._kick(worker, t)
            elif kind == _FEED:
                other += 1
                self._feed()
                if self._pending or gateway.active:
                    self._push(t + feed_every, _FEED, None)
            elif kind == _SESSIONS:
                if self._session_wake is not None and t >= self._session_wake:
                    self._session_wake = None
                for held in gateway.pump(t):  # a session's TTL or a round's longest wait ran out
                    self._kick(held, t)
                self._wake_sessions(t)
            elif kind == _PREPARE:
                request, _, _ = payload
                self._push(self.preparation.route_at(t, request.input_length), _ARRIVE, payload)
            else:
                other += 1
                self._load_tick()
                for held in gateway.pump(t):  # deadlines pass, reports change, with no step under way
                    self._kick(held, t)
                self._wake_sessions(t)
                if self._pending or gateway.active:
                    self._push(t + load_every, _LOAD, None)
        return events, other

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
        worker.events.hold()  # its blocks are stored once its time has passed (workers/sim/kv_events.py)
        duration, updates = worker.core.step(self._unix(t))
        self.stats.steps += 1
        for update in updates:  # scheduled now: a live worker says so as its step begins (workers/sim/engine.py)
            if update.ready is not None:
                self._ready(update)
        worker.pending = updates
        if duration <= 0.0:
            duration = 1e-9  # nothing could run (cannot happen with a consistent core); keep time moving
        self._push(t + duration, _STEP, worker)

    def _step_done(self, worker: SimWorker, t: float) -> None:
        updates = worker.pending
        worker.pending = None
        worker.events.publish()
        if updates:
            for update in updates:
                self._deliver(worker, update, t)
        self._dirty_load.add(worker)
        self._dirty_feed.add(worker)
        if worker.core.has_work():
            self._start_step(worker, t)
        else:
            worker.busy = False
        for held in self.gateway.pump(t):  # flow control: the step freed room for held requests
            self._kick(held, t)
        self._wake_sessions(t)

    def _wake_sessions(self, t: float) -> None:
        """An event at the next time a waiting session round may start, unless one comes sooner."""
        change = self.gateway.next_session_change(t)
        if change is not None and (self._session_wake is None or change < self._session_wake):
            self._session_wake = max(change, t)
            self._push(self._session_wake, _SESSIONS, None)

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

    def _ready(self, update: RequestUpdate) -> None:
        """The worker scheduled the request: the first leg's ready carries its cached tokens."""
        req = self._requests.get(update.request_id)
        ready, update.ready = update.ready, None
        if req is None or ready is None or req.emitted:
            return
        assert req.booking is not None
        req.booking.on_ready(self.now)
        mem, store = ready
        req.record.cached_tokens = mem + store
        self.stats.memory_tokens += mem
        self.stats.store_tokens += store
        self.stats.prompt_tokens += req.record.prompt_tokens or 0

    def _deliver(self, worker: SimWorker, update: RequestUpdate, t: float) -> None:
        req = self._requests.get(update.request_id)
        if req is None:
            return
        record = req.record
        if update.token_ids:
            if req.emitted == 0:
                record.ttft_s = self.preparation.relayed(t) - record.arrival_s
                assert req.booking is not None
                req.booking.unqueue()  # the first token ends its share of the queue
                self.gateway.started(req)
            else:
                record.itl_s.append(t - req.last_token_t)
            req.last_token_t = t
            req.emitted += len(update.token_ids)
        if update.finish is None:
            return
        assert req.booking is not None
        req.booking.end()
        worker.changed()
        if update.handoff and req.plan is not None and req.plan.mode is Mode.PD:
            self._push(t + self.config.gateway.handoff_overhead_s, _HANDOFF, req)
            return
        record.e2e_s = t - record.arrival_s
        record.output_tokens = req.emitted
        del self._requests[update.request_id]
        self.gateway.active -= 1
        self.gateway.finished(req)

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
