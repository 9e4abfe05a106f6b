"""SimEngine: the simulated DeepInfer engine in real time, behind the Engine seam.

An asyncio task drives the pure scheduler (core.py): it runs a step, sleeps the step's
(scaled) duration, then delivers what the step produced to per-request queues. When
steps are shorter than `min_sleep_s` (a large `time_scale`), several run back to back
before one sleep and their tokens go out as one `tokens` event: the same shape as
speculative decoding, and far fewer wake-ups. Steps end on fixed deadlines (previous
deadline + step time), so the loop's own overhead and late wake-ups do not make the
simulated clock drift; more than one step behind, the loop resyncs instead of bursting.
A step's KV events are published when its time has passed, with its tokens (kv_events.py).

Roles: `unified` serves any request; a `prefill` worker stops after the first token
and returns a KvHandoff (KV written to the shared store when there is one, otherwise
kept for a direct transfer); a `decode` worker starts from a KvHandoff, paying the KV
bytes at the store's or the direct link's bandwidth. Failure knobs (`Failures`) let
tests make a worker fail mid-stream or hang.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

from deepinfer_gateway.core.protocol import (
    DEFAULT_MODEL,
    ErrorKind,
    FinishReason,
    GenerateRequest,
    KvEventBatch,
    KvHandoff,
    LoadReport,
    Role,
    WorkerInfo,
    finish_event,
    ready_event,
    tokens_event,
)
from deepinfer_gateway.recipe_bridge.tokenizer import load_tokenizer
from deepinfer_gateway.workers.sim.core import AdmissionError, RequestUpdate, SchedulerCore, SimRequest
from deepinfer_gateway.workers.sim.kv_events import SimKvEventLog
from deepinfer_gateway.workers.sim.kv_store import SimKvStore
from deepinfer_gateway.workers.sim.output import OutputPlanner, fake_logprobs
from deepinfer_gateway.workers.sim.profiles import HardwareProfile
from deepinfer_gateway.workers.sim.step_model import kv_load_seconds

STORE_HANDLE, DIRECT_HANDLE = "store", "direct"
# Bounds the event loop's busy time per wake-up when time_scale makes steps near-free.
MAX_STEPS_PER_SLEEP = 64


@dataclass(frozen=True)
class Failures:
    """Failure injection for tests and chaos demos."""

    fail_after_tokens: int | None = None  # end every request with an `engine` error after N tokens
    hang: bool = False  # accept requests, never step (a wedged engine)


@dataclass
class _Stream:
    queue: asyncio.Queue[dict[str, Any]]
    prompt_len: int
    hashes: list[int]
    streamed: int = 0
    done: bool = False
    top_logprobs: int | None = None  # None: no logprobs asked for


class SimEngine:
    def __init__(
        self,
        *,
        worker_id: str,
        profile: HardwareProfile,
        role: Role = Role.UNIFIED,
        model: str = DEFAULT_MODEL,
        store: SimKvStore | None = None,
        time_scale: float = 1.0,
        planner: OutputPlanner | None = None,
        failures: Failures = Failures(),
        min_sleep_s: float = 0.002,
    ) -> None:
        self.profile = profile
        self.role = role
        self.store = store
        self.failures = failures
        self._worker_id = worker_id
        self._model = model
        self._planner = planner or OutputPlanner(load_tokenizer())
        self._min_sleep = min_sleep_s
        self._events = SimKvEventLog(worker_id)
        self._core = SchedulerCore(profile, self._events, model, store=store, time_scale=time_scale)
        self._streams: dict[str, _Stream] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def info(self) -> WorkerInfo:
        return WorkerInfo(
            worker_id=self._worker_id,
            engine="sim",
            role=self.role,
            hardware=self.profile.hardware,
            kv_format=self.profile.kv_format,
            model=self._model,
            dp_size=self.profile.dp_ranks,
            max_num_seqs=self.profile.max_num_seqs,
            scheduling_policy="priority" if self._core.by_priority else "fcfs",
            priority_preemption=self._core.by_priority,
            epoch=self._events.epoch,
        )

    @property
    def core(self) -> SchedulerCore:
        return self._core

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"sim-step-loop-{self._worker_id}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for rid, stream in list(self._streams.items()):
            self._core.abort(rid)
            self._close(stream, finish_event(FinishReason.ERROR, error_kind=ErrorKind.SHUTTING_DOWN))

    # --- requests ---------------------------------------------------------------------

    async def generate(self, request: GenerateRequest) -> AsyncGenerator[dict[str, Any], None]:
        rid = request.request_id
        try:
            stream = self._admit(request)
        except AdmissionError as err:
            yield finish_event(FinishReason.ERROR, error_kind=err.kind, message=str(err))
            return
        try:
            while True:
                event = await stream.queue.get()
                yield event
                if event["event"] == "finish":
                    return
        finally:
            if self._streams.get(rid) is stream:
                del self._streams[rid]
            if not stream.done:  # the consumer left early: free the engine
                self._core.abort(rid)

    async def abort(self, request_id: str) -> bool:
        stream = self._streams.get(request_id)
        if stream is None or stream.done:
            return False
        self._core.abort(request_id)
        self._close(stream, finish_event(FinishReason.ABORT, num_output_tokens=stream.streamed))
        return True

    def _admit(self, request: GenerateRequest) -> _Stream:
        if request.request_id in self._streams:
            raise AdmissionError(ErrorKind.INVALID_REQUEST, f"request {request.request_id!r} is already in flight")
        if self._task is None:
            raise AdmissionError(ErrorKind.SHUTTING_DOWN, "engine is not running")
        tokens = request.token_ids
        if min(tokens) < 0 or max(tokens) >= self._planner.vocab_size:
            raise AdmissionError(ErrorKind.INVALID_TOKENS, "token id outside the vocabulary")
        if request.priority and not self._core.by_priority:
            raise AdmissionError(ErrorKind.INVALID_REQUEST,
                                 "priority is set but this worker schedules first come, first served "
                                 "(its profile's scheduling_policy is not \"priority\")")
        role = request.role
        # A decode worker also prefills small prompts itself (PD bypass: role unified).
        bypass = self.role is Role.DECODE and role is Role.UNIFIED
        if self.role is not Role.UNIFIED and role is not self.role and not bypass:
            raise AdmissionError(ErrorKind.INVALID_REQUEST, f"a {self.role} worker cannot serve a {role} request")
        if role is Role.DECODE:
            sim = self._decode_request(request)
        else:
            plan = self._planner.plan(tokens, request.sampling)
            sim = SimRequest(
                request.request_id,
                tokens,
                plan.token_ids,
                plan.finish_reason,
                request.workload_class,
                stop_after_first=role is Role.PREFILL,
                cache_salt=request.cache_salt,
                priority=request.priority,
            )
        hashes = self._core.hashes(tokens, cache_salt=request.cache_salt)
        self._core.add_request(sim, hashes)
        sampling = request.sampling
        wants = sampling.logprobs or sampling.top_logprobs > 0
        # Images count in the prompt at their image token count (one placeholder each in `token_ids`).
        stream = _Stream(asyncio.Queue(), len(tokens) + request.image_token_adjustment, hashes,
                         top_logprobs=sampling.top_logprobs if wants else None)
        self._streams[request.request_id] = stream
        self._wake.set()
        return stream

    def _decode_request(self, request: GenerateRequest) -> SimRequest:
        handoff = request.kv_handoff
        if handoff is None or len(request.token_ids) < 2:
            raise AdmissionError(ErrorKind.INVALID_REQUEST,
                                 "a decode request needs kv_handoff and prompt + first token")
        if handoff.kv_format != self.profile.kv_format:
            raise AdmissionError(ErrorKind.KV_TRANSFER,
                                 f"KV format {handoff.kv_format} is not {self.profile.kv_format}")
        if handoff.handle.startswith(STORE_HANDLE + ":") and self.store is not None:
            bandwidth = self.profile.store_read_bytes_per_s
            if self.store.match(handoff.block_hashes, time.time()) < len(handoff.block_hashes):
                raise AdmissionError(ErrorKind.KV_TRANSFER, "handed-off KV is no longer in the store")
        else:
            bandwidth = self.profile.transfer_bytes_per_s
        # The output is planned from the prompt alone, so it continues the prefill's first token.
        plan = self._planner.plan(request.token_ids[:-1], request.sampling)
        return SimRequest(
            request.request_id,
            request.token_ids,
            plan.token_ids[1:],
            plan.finish_reason,
            request.workload_class,
            kv_loaded_seconds=kv_load_seconds(self.profile, handoff.num_tokens, bandwidth),
            cache_salt=request.cache_salt,
            priority=request.priority,
        )

    # --- step loop --------------------------------------------------------------------

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time()
        while True:
            if not self._core.has_work() or self.failures.hang:
                self._wake.clear()
                await self._wake.wait()
                deadline = loop.time()
                continue
            merged: dict[str, RequestUpdate] = {}
            elapsed, steps = 0.0, 0
            self._events.hold()  # its blocks are stored once its time has passed (kv_events.py)
            while self._core.has_work() and elapsed < self._min_sleep and steps < MAX_STEPS_PER_SLEEP:
                duration, updates = self._core.step(time.time())
                elapsed, steps = elapsed + duration, steps + 1
                for update in updates:
                    _merge(merged, update)
            for update in merged.values():  # scheduled now: say so before the step's time passes
                self._deliver_ready(update)
            # Fixed deadlines: the step ends one step time after the previous step's deadline,
            # not after "now", so the wake-up's lateness (sleep overshoot, delivery work, a busy
            # host) is caught up by the next sleep instead of adding to every step: a worker
            # under load keeps its modelled token rate, as a real engine's GPU clock would.
            # Behind by more than one step (host stalled, e.g. by other processes): resync to
            # now rather than run the missed steps back to back, which would burst many steps'
            # tokens at once (an ITL pattern no real engine shows) and starve the event loop.
            now = loop.time()
            if now - deadline > elapsed:
                deadline = now
            deadline += elapsed
            await asyncio.sleep(deadline - now)
            self._events.publish()
            for update in merged.values():
                self._deliver(update)

    def _deliver_ready(self, update: RequestUpdate) -> None:
        stream = self._streams.get(update.request_id)
        if update.ready is not None and stream is not None and not stream.done:
            stream.queue.put_nowait(ready_event(stream.prompt_len, *update.ready))
        update.ready = None

    def _deliver(self, update: RequestUpdate) -> None:
        stream = self._streams.get(update.request_id)
        if stream is None or stream.done:
            return
        put = stream.queue.put_nowait
        tokens = update.token_ids
        limit = self.failures.fail_after_tokens
        if limit is not None and stream.streamed + len(tokens) > limit:
            if limit > stream.streamed:
                put(_tokens(stream, tokens[: limit - stream.streamed]))
            stream.streamed = limit
            self._core.abort(update.request_id)
            self._close(stream,
                        finish_event(FinishReason.ERROR, error_kind=ErrorKind.ENGINE, message="injected failure"))
            return
        if tokens:
            stream.streamed += len(tokens)
            put(_tokens(stream, tokens))
        if update.finish is not None:
            handoff = self._handoff(update.request_id, stream) if update.handoff else None
            self._close(stream, finish_event(update.finish, kv_handoff=handoff, num_output_tokens=stream.streamed))

    def _handoff(self, request_id: str, stream: _Stream) -> KvHandoff:
        # The scheduler already wrote the prompt's blocks to the store (when there is one).
        kind = STORE_HANDLE if self.store is not None else DIRECT_HANDLE
        return KvHandoff(
            handle=f"{kind}:{self._worker_id}:{request_id}",
            source_worker=self._worker_id,
            kv_format=self.profile.kv_format,
            num_tokens=stream.prompt_len,
            block_hashes=tuple(stream.hashes),
        )

    @staticmethod
    def _close(stream: _Stream, event: dict[str, Any]) -> None:
        stream.done = True
        stream.queue.put_nowait(event)

    # --- reports ----------------------------------------------------------------------

    def load(self) -> LoadReport:
        ranks = self._core.rank_loads()
        return LoadReport(
            worker_id=self._worker_id,
            role=self.role,
            hardware=self.profile.hardware,
            kv_format=self.profile.kv_format,
            running=sum(r.running for r in ranks),
            waiting=sum(r.waiting for r in ranks),
            queued_prefill_tokens=sum(r.queued_prefill_tokens for r in ranks),
            kv_usage=self._core.kv_usage,
            memory_capacity_blocks=self.profile.memory_capacity_blocks,
            dp_ranks=ranks,
            prompt_tokens_total=self._core.prompt_tokens_total,
            cached_tokens_total=dict(self._core.cached_tokens_total),
            evicted_recomputed_tokens_total=self._core.evicted_recomputed_tokens_total,
            preemptions_total=self._core.preemptions_total,
            epoch=self._events.epoch,
        )

    def kv_events(self, after: int, limit: int = 10_000) -> KvEventBatch:
        return self._events.batch(after, limit)

    async def wait_kv_events(self, after: int, timeout_s: float) -> None:
        await self._events.wait_past(after, timeout_s)


def _tokens(stream: _Stream, token_ids: list[int]) -> dict[str, Any]:
    if stream.top_logprobs is None:
        return tokens_event(token_ids)
    return tokens_event(token_ids, fake_logprobs(token_ids, stream.top_logprobs))


def _merge(merged: dict[str, RequestUpdate], update: RequestUpdate) -> None:
    """Fold the updates of back-to-back steps into one per request."""
    prev = merged.get(update.request_id)
    if prev is None:
        merged[update.request_id] = update
        return
    prev.ready = prev.ready or update.ready
    prev.token_ids.extend(update.token_ids)
    prev.finish = update.finish or prev.finish
    prev.handoff = prev.handoff or update.handoff
    prev.num_output_tokens = update.num_output_tokens or prev.num_output_tokens
