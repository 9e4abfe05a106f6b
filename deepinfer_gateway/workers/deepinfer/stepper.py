"""The step thread: the only thread that ever touches the `LLMEngine`.

DeepInfer's engine is not thread-safe (C++ scheduler queues, CUDA streams bound at
construction), so it is built, stepped, fed and closed on one thread. The event loop
talks to it through a command deque guarded by a condition variable; the thread answers
with one `deliver(batch)` call per step (a list of `(request_id, protocol event)`) that
the owner forwards to the event loop with `call_soon_threadsafe`.

Loop, as in DeepInfer's own offline `LLM._run_engine`: `step()` while
`has_unfinished_requests()`, then ONE `flush_inflight_reqs()` (zero-overhead scheduling
returns a step's tokens one step late), then sleep on the condition until a command.
With data parallelism `has_unfinished_requests` is an all-reduce over the DP group, so
every rank must keep calling it: the idle wait then polls every `dp_poll_s`.
"""

from __future__ import annotations

import base64
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from deepinfer_gateway.core.protocol import (
    ErrorKind,
    FinishReason,
    GenerateRequest,
    KvHandoff,
    KvTier,
    Role,
    finish_event,
    ready_event,
    tokens_event,
)
from deepinfer_gateway.workers.deepinfer.api import DeepInferApi
from deepinfer_gateway.workers.deepinfer.config import DeepInferConfig
from deepinfer_gateway.workers.deepinfer.events import KvEventLog
from deepinfer_gateway.workers.deepinfer.handoff import HandoffError, KvHandoffs
from deepinfer_gateway.workers.deepinfer.kvstore import KvStore
from deepinfer_gateway.workers.deepinfer.mapping import map_finish, sampling_kwargs
from deepinfer_gateway.workers.deepinfer.step_messages import (
    Abort,
    Add,
    Batch,
    Command,
    LoadSnapshot,
    RequestError,
    Stop,
)
from deepinfer_gateway.workers.deepinfer.transfer import KvTransfer, pd_engine_class

log = logging.getLogger(__name__)

# The worker's role -> the `EngineType` member its LLMEngine is built with.
ENGINE_TYPES = {Role.UNIFIED: "NORMAL", Role.PREFILL: "PROMPT", Role.DECODE: "COMPLETION"}


@dataclass(slots=True)
class _Live:
    request: GenerateRequest
    seq: Any
    want_logprobs: bool
    stop_ids: frozenset[int]
    cached_store: int = 0
    ready_sent: bool = False
    num_out: int = 0
    handoff: KvHandoff | None = None
    handoff_error: str | None = None
    tokens: list[int] = field(default_factory=list)  # this step's, reset per step
    logprobs: list[Any] = field(default_factory=list)


class Stepper:
    """Owns the step thread and the `LLMEngine` on it; the event loop only calls `start`,
    `submit`, `join` and `is_alive` and reads `load`, the token counters and `failure`."""

    def __init__(
        self,
        config: DeepInferConfig,
        api: DeepInferApi,
        deliver: Callable[[Batch], None],
        events: KvEventLog,
        kv_store: KvStore | None,
        kv_transfer: KvTransfer,
        clock: Callable[[], float],
    ) -> None:
        self._config = config
        self._api = api
        self._deliver = deliver
        self._handoffs = KvHandoffs(config, kv_store, events, clock)
        self._transfer = kv_transfer
        self._role = config.role
        self._engine_type = getattr(api.EngineType, ENGINE_TYPES[config.role])
        base = api.LLMEngine
        self._engine_cls = (
            pd_engine_class(base, kv_transfer, self._on_prompt_kv) if config.role is Role.PREFILL else base
        )
        self._cmds: deque[Command] = deque()
        self._closed = False
        self._wake = threading.Condition()
        self._live: dict[str, _Live] = {}
        self._llm: Any = None
        self._batch: Batch = []
        self.load = LoadSnapshot()
        self.prompt_tokens_total = 0
        self.cached_tokens_total = {KvTier.MEMORY: 0, KvTier.STORE: 0}
        self.failure: BaseException | None = None  # set when the engine broke: the worker is unhealthy
        self.started = threading.Event()
        self.start_error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name=f"deepinfer-step-{config.worker_id}", daemon=True)

    # --- event-loop side ----------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def submit(self, cmd: Command) -> bool:
        """False once the step thread has ended (the caller answers for it)."""
        with self._wake:
            if self._closed:
                return False
            self._cmds.append(cmd)
            self._wake.notify()
            return True

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    # --- step thread ----------------------------------------------------------------------

    def _main(self) -> None:
        try:
            args = self._api.EngineArgs(**self._config.engine_args_kwargs(self._engine_type))
            self._llm = self._engine_cls.from_engine_args(args)
            if self._role is not Role.UNIFIED:
                self._transfer.check(self._llm)
        except BaseException as exc:  # reported to start() on the loop
            self.start_error = exc
            self._fail_commands(ErrorKind.ENGINE, f"engine failed to start: {exc!r}")
            self._close_engine()
            self.started.set()
            return
        self._refresh_load()
        self.started.set()
        try:
            self._loop()
        except BaseException as exc:
            log.exception("DeepInfer engine failed; worker is now unhealthy")
            self.failure = exc
            for rid in list(self._live):
                self._finish(rid, FinishReason.ERROR, ErrorKind.ENGINE, f"engine failure: {exc!r}")
            self._flush_batch()
        if self.failure is None:
            self._fail_commands(ErrorKind.SHUTTING_DOWN, "worker shut down")
        else:
            self._fail_commands(ErrorKind.ENGINE, f"engine failure: {self.failure!r}")
        self._close_engine()

    def _loop(self) -> None:
        llm = self._llm
        poll = self._config.dp_poll_s if self._config.dp_size > 1 else None
        flushed = True
        deadline: float | None = None
        while True:
            with self._wake:
                if not self._cmds and flushed:
                    timeout = poll
                    if deadline is not None:
                        timeout = max(0.0, deadline - time.monotonic()) if timeout is None else timeout
                    self._wake.wait(timeout)
                cmds = list(self._cmds)
                self._cmds.clear()
            for cmd in cmds:
                if isinstance(cmd, Stop):
                    deadline = cmd.deadline if deadline is None else min(deadline, cmd.deadline)
                else:
                    self._apply(cmd, accepting=deadline is None)
            self._flush_batch()
            if deadline is not None and (not self._live or time.monotonic() >= deadline):
                self._abort_all()
                return
            if llm.has_unfinished_requests():
                self._dispatch(llm.step())
                flushed = False
            elif not flushed:
                self._dispatch(llm.flush_inflight_reqs())
                flushed = True
                self._orphans()
            self._refresh_load()

    def _apply(self, cmd: Add | Abort, accepting: bool) -> None:
        if isinstance(cmd, Abort):
            live = cmd.request_id in self._live
            if live:
                self._llm.abort_request(cmd.request_id)
                self._finish(cmd.request_id, FinishReason.ABORT)
            if cmd.reply is not None:
                cmd.reply(live)
            return
        request = cmd.request
        rid = request.request_id
        if not accepting:
            self._reject(request, ErrorKind.SHUTTING_DOWN, "worker is shutting down")
        elif rid in self._live:
            self._reject(request, ErrorKind.INVALID_REQUEST, f"request id {rid!r} is already in flight")
        else:
            try:
                self._admit(request)
            except RequestError as exc:
                self._reject(request, exc.kind, str(exc))

    def _admit(self, request: GenerateRequest) -> None:
        np = self._api.np
        decode = self._role is Role.DECODE
        if decode != (request.kv_handoff is not None):
            raise RequestError(ErrorKind.INVALID_REQUEST, "kv_handoff is required on decode workers and only there")
        sampling = request.sampling
        if decode:  # max_tokens is the whole answer's budget; prefill already produced one token
            sampling = sampling.model_copy(update={"max_tokens": max(1, sampling.max_tokens - 1)})
        try:
            params = self._api.SamplingParams(**sampling_kwargs(sampling))
        except (ValueError, TypeError) as exc:
            raise RequestError(ErrorKind.INVALID_REQUEST, f"sampling: {exc}") from exc
        try:
            prompt = np.asarray(request.token_ids, dtype=np.int32)
        except OverflowError as exc:
            raise RequestError(ErrorKind.INVALID_TOKENS, "token id outside int32") from exc
        images = {"image_bytes": [base64.b64decode(i) for i in request.images]} if request.images else None
        blocks = self._handoffs.fetch(request) if decode else None
        try:
            seq = self._llm.add_request(
                "gateway", request.request_id, params, prompt, multi_modal_data=images, enqueue=not decode
            )
        except ValueError as exc:  # empty prompt (after image expansion)
            raise RequestError(ErrorKind.INVALID_REQUEST, str(exc)) from exc
        if seq is None:
            raise RequestError(ErrorKind.INVALID_TOKENS, "token ids outside the model's vocabulary")
        live = _Live(
            request=request,
            seq=seq,
            want_logprobs=request.sampling.logprobs or request.sampling.top_logprobs > 0,
            stop_ids=frozenset(request.sampling.stop_token_ids),
        )
        if blocks is not None:
            try:
                self._transfer.import_prompt_kv(self._llm, seq, blocks)
            except Exception as exc:
                raise RequestError(ErrorKind.KV_TRANSFER, f"loading KV failed: {exc!r}") from exc
            assert request.kv_handoff is not None
            live.cached_store = request.kv_handoff.num_tokens
        self._live[request.request_id] = live

    def _on_prompt_kv(self, request_id: str, blocks: list[bytes]) -> None:
        """Prefill side, from `pe_do_save_kvcache` on this thread: store the prompt's KV
        and remember the hand-off. Errors stay with the request, never reach the engine."""
        live = self._live.get(request_id)
        if live is None or self._handoffs.store is None:
            return
        try:
            live.handoff = self._handoffs.save(live.request, blocks)
        except HandoffError as exc:
            live.handoff_error = str(exc)

    def _dispatch(self, outputs: Iterable[Any]) -> None:
        """Read this step's handles (valid only until the next step) into per-request events."""
        ro = self._api.RequestOutput
        touched: dict[str, _Live] = {}
        finished: dict[str, str] = {}
        for h in outputs:
            rid = ro.get_request_id(h)
            live = self._live.get(rid)
            if live is None or rid in finished:
                continue  # aborted/stopped by us, or not ours
            touched[rid] = live
            reason = ro.get_finish_reason(h) if ro.get_finished(h) else ""
            if reason not in ("", "stop", "length"):
                finished[rid] = reason  # error/abort handles carry no real token
                continue
            token = ro.get_token_id(h)
            if reason == "stop" or token in live.stop_ids:
                # A stop token (the EOS the engine sampled, or one of stop_token_ids) ends
                # the request and, per the worker protocol, is neither streamed nor counted.
                finished[rid] = "stop"
                if not reason:
                    self._llm.abort_request(rid)  # DeepInfer has no stop_token_ids: end it ourselves
                continue
            live.tokens.append(token)
            if live.want_logprobs:
                top = [[t, lp] for t, lp in zip(ro.get_top_token_ids(h), ro.get_top_logprobs(h), strict=False)]
                live.logprobs.append([ro.get_token_logprobs(h), top])
            if reason:
                finished[rid] = reason
        for rid, live in touched.items():
            self._emit_tokens(live)
            if rid in finished:
                self._finish(rid, *map_finish(finished[rid]))
            elif self._role is Role.PREFILL and live.num_out:
                self._handoff(rid, live)
        self._flush_batch()

    def _emit_tokens(self, live: _Live) -> None:
        self._send_ready(live)
        if live.tokens:
            rid = live.request.request_id
            self._batch.append((rid, tokens_event(live.tokens, live.logprobs if live.want_logprobs else None)))
            live.num_out += len(live.tokens)
            live.tokens, live.logprobs = [], []

    def _handoff(self, rid: str, live: _Live) -> None:
        """Prefill returns after the first token: free the sequence, hand off its KV."""
        self._llm.abort_request(rid)
        if live.handoff is None:
            self._finish(
                rid, FinishReason.ERROR, ErrorKind.KV_TRANSFER, live.handoff_error or "prompt KV was not saved"
            )
        else:
            self._finish(rid, FinishReason.STOP, kv_handoff=live.handoff)

    def _send_ready(self, live: _Live) -> None:
        if live.ready_sent:
            return
        live.ready_sent = True
        # What the engine prefills: one placeholder per image in token_ids plus the image
        # tokens beyond it (DeepInfer expands them from multi_modal_data), as the sim counts.
        prompt = len(live.request.token_ids) + live.request.image_token_adjustment
        memory = int(getattr(live.seq, "cached_hit_tokens", 0) or 0)  # no prefix cache in 0.1.0: 0
        self.prompt_tokens_total += prompt
        self.cached_tokens_total[KvTier.MEMORY] += memory
        self.cached_tokens_total[KvTier.STORE] += live.cached_store
        self._batch.append((live.request.request_id, ready_event(prompt, memory, live.cached_store)))

    def _finish(
        self,
        rid: str,
        reason: FinishReason,
        kind: ErrorKind | None = None,
        message: str | None = None,
        kv_handoff: KvHandoff | None = None,
    ) -> None:
        live = self._live.pop(rid)
        self._send_ready(live)
        event = finish_event(
            reason, error_kind=kind, message=message, kv_handoff=kv_handoff, num_output_tokens=live.num_out
        )
        self._batch.append((rid, event))

    def _reject(self, request: GenerateRequest, kind: ErrorKind, message: str) -> None:
        rid = request.request_id
        self._batch.append((rid, ready_event(len(request.token_ids), 0, 0)))
        self._batch.append((rid, finish_event(FinishReason.ERROR, error_kind=kind, message=message)))

    def _orphans(self) -> None:
        """After a flush with nothing unfinished, any request still live was dropped
        silently by the engine: end it rather than hang its stream."""
        for rid in list(self._live):
            self._finish(rid, FinishReason.ERROR, ErrorKind.ENGINE, "engine finished without a final output")
        self._flush_batch()

    def _abort_all(self) -> None:
        """Shutdown: abort what is left (retryable for the gateway), drain the in-flight step."""
        if self._live:
            self._llm.abort_request(list(self._live))
            for rid in list(self._live):
                self._finish(rid, FinishReason.ERROR, ErrorKind.SHUTTING_DOWN, "worker shut down")
        self._flush_batch()
        self._llm.flush_inflight_reqs()

    def _fail_commands(self, kind: ErrorKind, message: str) -> None:
        """Close the command queue and answer what is left in it (those streams would hang)."""
        with self._wake:
            self._closed = True
            cmds = list(self._cmds)
            self._cmds.clear()
        for cmd in cmds:
            if isinstance(cmd, Add):
                self._reject(cmd.request, kind, message)
            elif isinstance(cmd, Abort) and cmd.reply is not None:
                cmd.reply(False)
        self._flush_batch()

    def _flush_batch(self) -> None:
        if self._batch:
            batch, self._batch = self._batch, []
            self._deliver(batch)

    def _refresh_load(self) -> None:
        self.load = LoadSnapshot.read(self._llm)

    def _close_engine(self) -> None:
        if self._llm is not None:
            try:
                self._llm.close()
            except Exception:
                log.exception("LLMEngine.close() failed")
