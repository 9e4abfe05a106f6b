"""`DeepInferEngine`: DeepInfer's `LLMEngine` behind the worker `Engine` seam.

The asyncio half: per-request event queues, abort, load and KV-event reads. All engine
work happens on the step thread (stepper.py); events come back one batch per step via
`loop.call_soon_threadsafe`, so the event loop never blocks on the engine.

Roles map to `EngineArgs.engine_type`: unified -> NORMAL, prefill -> PROMPT (returns
after the first token with a `KvHandoff`; KV goes to the KV store through the prefill
save hooks), decode -> COMPLETION (loads the hand-off's KV before its first step).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from deepinfer_gateway.core.protocol import (
    DpRankLoad,
    ErrorKind,
    FinishReason,
    GenerateRequest,
    KvEventBatch,
    LoadReport,
    Role,
    WorkerInfo,
    finish_event,
    ready_event,
)
from deepinfer_gateway.workers.deepinfer.api import DeepInferApi, load_api
from deepinfer_gateway.workers.deepinfer.config import DeepInferConfig
from deepinfer_gateway.workers.deepinfer.events import KvEventLog
from deepinfer_gateway.workers.deepinfer.kvstore import FileKvStore, KvStore
from deepinfer_gateway.workers.deepinfer.step_messages import Abort, Add, Batch, Event, Stop
from deepinfer_gateway.workers.deepinfer.stepper import Stepper
from deepinfer_gateway.workers.deepinfer.transfer import KvTransfer, UnavailableKvTransfer


class DeepInferEngine:
    """One DeepInfer `LLMEngine` (one DP rank) serving worker protocol v1.

    `api` / `api_root` inject the engine module (tests use the interface double);
    without them `deepinfer` is imported here and a missing install raises
    `DeepInferNotInstalled` naming what to install. PD roles need `kv_store` and a
    `kv_transfer` adapter (see transfer.py for why none works on real 0.1.0 yet).
    """

    def __init__(
        self,
        config: DeepInferConfig,
        *,
        api: DeepInferApi | None = None,
        api_root: str = "deepinfer",
        kv_store: KvStore | None = None,
        kv_transfer: KvTransfer | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if config.role is not Role.UNIFIED and kv_store is None:
            raise ValueError(f"role {config.role.value} needs a KV store (kv_store_dir) for the PD hand-off")
        self._config = config
        self._api = api or load_api(api_root)
        self._kv_store = kv_store
        self._kv_transfer = kv_transfer or UnavailableKvTransfer()
        self._clock = clock
        self._events = KvEventLog(config.worker_id, retain=config.kv_events_retain)
        self._streams: dict[str, asyncio.Queue[Event]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stepper: Stepper | None = None
        self._stopping = False

    # --- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        """Build the `LLMEngine` on its own thread (loading weights takes minutes)."""
        if self._stepper is not None:
            raise RuntimeError("DeepInferEngine.start() called twice")
        self._loop = asyncio.get_running_loop()
        self._events.restart()
        self._stepper = Stepper(
            self._config,
            self._api,
            self._deliver_threadsafe,
            self._events,
            self._kv_store,
            self._kv_transfer,
            self._clock,
        )
        self._stepper.start()
        await asyncio.to_thread(self._stepper.started.wait)
        if self._stepper.start_error is not None:
            raise RuntimeError(f"DeepInfer engine failed to start: {self._stepper.start_error!r}") from (
                self._stepper.start_error
            )

    async def stop(self) -> None:
        """Stop accepting, let in-flight requests finish for `drain_timeout_s`, then abort
        the rest (each gets a retryable `shutting_down` finish), flush, close the engine."""
        self._stopping = True
        stepper = self._stepper
        if stepper is None:
            return
        stepper.submit(Stop(deadline=time.monotonic() + self._config.drain_timeout_s))
        await asyncio.to_thread(stepper.join)
        await asyncio.sleep(0)  # let the last call_soon_threadsafe deliveries run

    @property
    def healthy(self) -> bool:
        """False once the engine raised in a step; the worker server reports it on /health."""
        s = self._stepper
        return s is not None and s.failure is None and s.start_error is None and s.is_alive()

    # --- requests -------------------------------------------------------------------------

    async def generate(self, request: GenerateRequest) -> AsyncIterator[dict[str, Any]]:
        rid = request.request_id
        refusal = self._refusal(request)
        if refusal is not None:
            for event in refusal:
                yield event
            return
        assert self._stepper is not None
        queue: asyncio.Queue[Event] = asyncio.Queue()
        self._streams[rid] = queue
        finished = False
        try:
            if not self._stepper.submit(Add(request)):
                for event in self._refused(request, ErrorKind.SHUTTING_DOWN, "worker is shutting down"):
                    yield event
                finished = True
                return
            while True:
                event = await queue.get()
                finished = event["event"] == "finish"
                yield event
                if finished:
                    return
        finally:
            if self._streams.get(rid) is queue:
                del self._streams[rid]
            if not finished:  # the consumer left early (client gone): free the engine's slot
                self._stepper.submit(Abort(rid))

    async def abort(self, request_id: str) -> bool:
        stepper = self._stepper
        if stepper is None or request_id not in self._streams:
            return False
        loop = asyncio.get_running_loop()
        done: asyncio.Future[bool] = loop.create_future()

        def settle(was_live: bool) -> None:
            if not done.done():
                done.set_result(was_live)

        def reply(was_live: bool) -> None:  # step thread
            loop.call_soon_threadsafe(settle, was_live)

        if not stepper.submit(Abort(request_id, reply)):
            return False
        return await done

    # --- reports --------------------------------------------------------------------------

    @property
    def info(self) -> WorkerInfo:
        c = self._config
        return WorkerInfo(
            worker_id=c.worker_id,
            engine="deepinfer",
            role=c.role,
            hardware=c.hardware,
            kv_format=c.resolved_kv_format,
            model=c.served_model,
            dp_size=c.dp_size,
            max_num_seqs=c.max_num_seqs,
            prefills=c.role is not Role.DECODE,  # a COMPLETION engine only continues handed-off KV
            epoch=self._events.epoch,
        )

    def load(self) -> LoadReport:
        """From the step thread's last snapshot (the engine is never read off-thread).
        One DP rank per process: `dp_ranks` holds this process's rank only."""
        c = self._config
        s = self._stepper
        snap = s.load if s is not None else None
        running = snap.running if snap else 0
        waiting = snap.waiting if snap else 0
        queued = snap.queued_prefill_tokens if snap else 0
        return LoadReport(
            worker_id=c.worker_id,
            role=c.role,
            hardware=c.hardware,
            kv_format=c.resolved_kv_format,
            running=running,
            waiting=waiting,
            queued_prefill_tokens=queued,
            kv_usage=snap.kv_usage if snap else 0.0,
            memory_capacity_blocks=snap.capacity_blocks if snap else 0,
            dp_ranks=[
                DpRankLoad(
                    dp_rank=snap.dp_rank if snap else 0, running=running, waiting=waiting, queued_prefill_tokens=queued
                )
            ],
            prompt_tokens_total=s.prompt_tokens_total if s else 0,
            cached_tokens_total=dict(s.cached_tokens_total) if s else {},
            epoch=self._events.epoch,
        )

    def kv_events(self, after: int, limit: int = 10_000) -> KvEventBatch:
        return self._events.batch(after, limit)

    async def wait_kv_events(self, after: int, timeout_s: float) -> None:
        await self._events.wait_past(after, timeout_s)

    # --- internals ------------------------------------------------------------------------

    def _refusal(self, request: GenerateRequest) -> list[Event] | None:
        s = self._stepper
        if s is None:
            return self._refused(request, ErrorKind.SHUTTING_DOWN, "worker is not started")
        if s.failure is not None or s.start_error is not None:
            return self._refused(request, ErrorKind.ENGINE, "engine failed; worker is unhealthy")
        if self._stopping:
            return self._refused(request, ErrorKind.SHUTTING_DOWN, "worker is shutting down")
        if request.sampling.min_tokens:
            return self._refused(request, ErrorKind.INVALID_REQUEST,
                                 "min_tokens is not supported by DeepInfer workers (SamplingParams has no minimum)")
        if request.cache_salt is not None:  # served unsalted, the blocks would be shared: refused, not ignored
            return self._refused(request, ErrorKind.INVALID_REQUEST,
                                 "cache_salt is not supported by DeepInfer workers (their prefix cache has no salt)")
        if request.priority:  # WorkerInfo says scheduling_policy "fcfs": the gateway sends none
            return self._refused(request, ErrorKind.INVALID_REQUEST,
                                 "priority is not supported by DeepInfer workers (LLMEngine schedules first come, "
                                 "first served)")
        if request.request_id in self._streams:
            return self._refused(request, ErrorKind.INVALID_REQUEST, f"request id {request.request_id!r} is in flight")
        return None

    @staticmethod
    def _refused(request: GenerateRequest, kind: ErrorKind, message: str) -> list[Event]:
        return [
            ready_event(len(request.token_ids), 0, 0),
            finish_event(FinishReason.ERROR, error_kind=kind, message=message),
        ]

    def _deliver_threadsafe(self, batch: Batch) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._deliver, batch)

    def _deliver(self, batch: Batch) -> None:
        streams = self._streams
        for rid, event in batch:
            queue = streams.get(rid)
            if queue is not None:
                queue.put_nowait(event)


def build_deepinfer_engine(config: DeepInferConfig, *, kv_transfer: KvTransfer | None = None) -> DeepInferEngine:
    """What `deepinfer-gateway worker --engine deepinfer` calls: real `deepinfer`, and a
    `FileKvStore` on `config.kv_store_dir` when given (required for prefill/decode)."""
    store = FileKvStore(config.kv_store_dir) if config.kv_store_dir else None
    return DeepInferEngine(config, kv_store=store, kv_transfer=kv_transfer)
