"""Background Responses (`background: true`): run as a task of the gateway, read from the store.

`POST /v1/responses` with `background: true` (which needs `store`) answers at once: the
response object with status `queued`, or, with `stream: true`, an SSE stream that follows the
run. The request itself runs as a task of this gateway process (it holds the key's in-flight
slot and token reservation as a plain request does): always streamed from the worker, its
record in the store rewritten as it goes (in_progress at its first token, then completed,
incomplete or failed) and, when the client asked for a stream, each event kept with its
sequence number (background_store.py). So:

- `GET /v1/responses/{id}` polls it (any replica: the state is in the store);
- `POST /v1/responses/{id}/cancel` sets it cancelled (a compare-and-set: a run that finished
  first stays finished) and aborts the engine request: at once when the run is in this
  process, else within `BEAT_S` when its runner next reports and learns it was cancelled;
- `GET /v1/responses/{id}?stream=true&starting_after=N` replays the kept events after sequence
  number N, then follows the run live (woken by the runner in this process, else polling the
  store every `POLL_S`) until it ends.

A run reports (`beat`) every `BEAT_S`. A gateway stopped gracefully marks its runs failed
("the gateway stopped"); one that died cannot, so a run not heard of for `STALE_S` is marked
failed by the next read of it. A run whose store fails (a Redis outage) cannot record its
progress: it is aborted, and is marked failed by a read once the store is back and STALE_S have
passed since its last report.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import orjson
from starlette.responses import JSONResponse, Response, StreamingResponse

from deepinfer_gateway.core.errors import GatewayError
from deepinfer_gateway.gateway.serving.background import run_in_background
from deepinfer_gateway.gateway.serving.background_store import GONE, RUNNING, BackgroundStore, RunState
from deepinfer_gateway.gateway.serving.relay import RelayResponse
from deepinfer_gateway.gateway.serving.response_store import StoredResponse

log = logging.getLogger(__name__)
T = TypeVar("T")

BEAT_S = 1.0  # a run reports this often (and learns of a cancel made on another replica)
STALE_S = 10.0  # a run not heard of for this long is failed: its gateway died
POLL_S = 0.05  # a follower of a run in another process reads the store this often
CANCELLED, FAILED = "cancelled", "failed"
_FINAL_TYPES = ("response.completed", "response.incomplete")
_SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}

Call = Callable[[Callable[[], Awaitable[Any]]], Awaitable[Any]]


class _Stopped(Exception):
    """The run must not go on: cancelled, deleted, or its state cannot be recorded."""


def _frame(event: dict[str, Any]) -> bytes:
    return b"event: " + str(event["type"]).encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"


def _parse(raw: bytes) -> dict[str, Any] | None:
    for line in raw.split(b"\n"):
        if line.startswith(b"data: "):
            try:
                event = orjson.loads(line[6:])
            except orjson.JSONDecodeError:
                return None
            return event if isinstance(event, dict) else None
    return None


async def _never() -> dict[str, Any]:
    await asyncio.Event().wait()  # the relay asks only under ASGI < 2.4; it is told 2.4
    return {"type": "http.disconnect"}


@dataclass(eq=False)
class Run:
    """A run in this process."""

    owner: str
    response_id: str
    response: dict[str, Any]  # the response object as last recorded
    input_items: list[dict[str, Any]]
    stream: bool  # its events are kept (the client asked for a stream)
    extra: dict[str, Any]  # set in each response object it records (background, store, conversation)
    on_final: Callable[[dict[str, Any]], Awaitable[None]]  # its final response object (a conversation's append)
    task: asyncio.Task[None] | None = None
    stop_reason: str = ""  # why this process cancels it: cancelled or shutdown
    buffer: bytes = b""
    next_seq: int = 0
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def notify(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()


class BackgroundResponses:
    def __init__(self, store: BackgroundStore, call: Call, on_end: Callable[[str], None]):
        self.store = store
        self._call = call  # the stored responses' outage handling (StoreUnavailable)
        self._on_end = on_end  # dgw_background_responses_total{outcome}
        self._runs: dict[tuple[str, str], Run] = {}

    # --- starting and running -----------------------------------------------------------------
    async def start(self, run: Run, serving: Awaitable[Response], on_end: Callable[[], None]) -> Response:
        """Record it queued and start its task; the answer to its POST. `on_end`: the request's
        slot and reservation back when it did not reach a worker (idempotent)."""
        try:
            await self._call(lambda: self.store.start(run.owner, run.response_id,
                                                      StoredResponse(run.response, run.input_items)))
            if run.stream:
                event = {"type": "response.created", "response": run.response, "sequence_number": 0}
                await self._call(lambda: self.store.advance(run.owner, run.response_id, events=(_frame(event),)))
                run.next_seq = 1
        except BaseException:
            if asyncio.iscoroutine(serving):
                serving.close()
            on_end()
            raise
        self._runs[(run.owner, run.response_id)] = run
        run.task = run_in_background(self._run(run, serving, on_end))
        if run.stream:
            return self.follow(run.owner, run.response_id, 0)
        return JSONResponse(run.response)

    async def _run(self, run: Run, serving: Awaitable[Response], on_end: Callable[[], None]) -> None:
        beat = run_in_background(self._beat(run))
        try:
            response = await serving
            if not isinstance(response, RelayResponse):  # an error answered by the worker
                await self._fail(run, _error_message(response))
                return
            await response({"type": "http", "asgi": {"spec_version": "2.4"}}, _never, lambda m: self._send(run, m))
            if run.response.get("status") in RUNNING:
                await self._fail(run, "The worker's stream ended without a final event.")
        except _Stopped:
            pass
        except asyncio.CancelledError:
            if run.stop_reason == "shutdown":
                await self._fail(run, "The gateway running this background response stopped.")
        except GatewayError as exc:
            await self._fail(run, exc.message)
        except Exception:
            log.exception("background response %s failed", run.response_id)
            await self._fail(run, "The gateway failed while running this response.")
        finally:
            beat.cancel()
            on_end()
            self._runs.pop((run.owner, run.response_id), None)
            run.notify()

    async def _beat(self, run: Run) -> None:
        while True:
            await asyncio.sleep(BEAT_S)
            try:
                state = await self._call(lambda: self.store.advance(run.owner, run.response_id))
            except GatewayError:  # the store failing: the run's own next write stops it
                continue
            if state not in RUNNING and run.task is not None:
                run.stop_reason = state
                run.task.cancel()
                return

    async def _advance(self, run: Run, *, state: str = "", response: dict[str, Any] | None = None,
                       events: tuple[bytes, ...] = (), fail_when_full: bool = True) -> None:
        """Record progress; _Stopped when the run must end (cancelled, deleted, full, the store failing)."""
        stored = None
        if response is not None:
            run.response = {**response, **run.extra}
            stored = StoredResponse(run.response, run.input_items)
        try:
            after = await self._call(lambda: self.store.advance(run.owner, run.response_id, state=state,
                                                                stored=stored, events=events))
        except GatewayError as exc:
            log.warning("background response %s: its progress cannot be recorded (%s); aborted", run.response_id,
                        exc.message)
            raise _Stopped() from None
        run.notify()
        if state and after == state:
            if state not in RUNNING:
                self._on_end(state)
            return
        if after in RUNNING:
            return
        if after == "full" and fail_when_full:
            await self._fail(run, "The response and its events passed the stored responses' byte bounds.")
        raise _Stopped()  # cancelled, deleted, or already ended

    async def _send(self, run: Run, message: dict[str, Any]) -> None:
        """The relay's ASGI `send`: its SSE events, renumbered after ours and recorded."""
        if message["type"] != "http.response.body":
            return
        *complete, run.buffer = (run.buffer + message.get("body", b"")).split(b"\n\n")
        events: list[bytes] = []
        state, record = "", None  # the status and response object to record, if they change
        for raw in complete:
            event = _parse(raw)
            if event is None or event.get("type") == "response.created":  # ours said it (queued)
                continue
            kind = str(event.get("type"))
            if isinstance(event.get("response"), dict):
                event["response"] = {**event["response"], **run.extra}
            if kind == "response.in_progress" or kind in _FINAL_TYPES:
                record = event["response"]
                state = str(record.get("status") or kind.removeprefix("response."))
            elif kind == "error":  # the relay's frame for a worker failing mid-stream
                record, state = _failed(run.response, str(event.get("message"))), FAILED
                event = {"type": "response.failed", "response": record}
            event["sequence_number"] = run.next_seq
            run.next_seq += 1
            events.append(_frame(event))
        if (events and run.stream) or record is not None:
            await self._advance(run, state=state, response=record, events=tuple(events) if run.stream else ())
        if record is not None and state not in RUNNING:
            await run.on_final(run.response)

    async def _fail(self, run: Run, message: str) -> None:
        """Record it failed (unless it ended meanwhile); never raises."""
        failed = _failed(run.response, message)
        events = (_frame({"type": "response.failed", "response": failed, "sequence_number": run.next_seq}),)
        try:
            await self._advance(run, state=FAILED, response=failed, events=events if run.stream else (),
                                fail_when_full=False)
        except _Stopped:
            pass

    async def stop(self) -> None:
        """The gateway stops: its runs end failed (the engine requests aborted)."""
        runs = list(self._runs.values())
        for run in runs:
            run.stop_reason = "shutdown"
            if run.task is not None:
                run.task.cancel()
        await asyncio.gather(*(run.task for run in runs if run.task is not None), return_exceptions=True)

    # --- reading -------------------------------------------------------------------------------
    async def settle(self, owner: str, response_id: str, stored: StoredResponse) -> StoredResponse:
        """A stored background response as it stands: one still running whose runner has not
        reported for STALE_S (its gateway died) is failed first."""
        if not stored.response.get("background") or stored.response.get("status") not in RUNNING:
            return stored
        run: RunState | None = await self._call(lambda: self.store.run_state(owner, response_id))
        if run is None or not self._stale(owner, response_id, run):
            return stored
        failed = _failed(stored.response, "The gateway running this background response stopped before it "
                                           "finished.")
        events = (_frame({"type": "response.failed", "response": failed, "sequence_number": run.events}),)
        after = await self._call(lambda: self.store.advance(owner, response_id, state=FAILED,
                                                            stored=StoredResponse(failed, stored.input_items),
                                                            events=events if run.events else ()))
        if after == FAILED:
            self._on_end(FAILED)
            return StoredResponse(failed, stored.input_items)
        return stored

    def _stale(self, owner: str, response_id: str, run: RunState) -> bool:
        return (run.state in RUNNING and (owner, response_id) not in self._runs
                and time.time() - run.beat > STALE_S)

    async def cancel(self, owner: str, response_id: str, stored: StoredResponse) -> dict[str, Any] | str:
        """The cancelled response object, or the status that keeps it from being cancelled
        ("" when it is not a background response)."""
        run: RunState | None = await self._call(lambda: self.store.run_state(owner, response_id))
        if run is None:
            return ""
        if run.state == CANCELLED:
            return dict(stored.response)
        if run.state not in RUNNING:
            return run.state
        cancelled = {**stored.response, "status": CANCELLED}
        after = await self._call(lambda: self.store.advance(owner, response_id, state=CANCELLED,
                                                            stored=StoredResponse(cancelled, stored.input_items)))
        if after == GONE:
            return ""
        if after != CANCELLED:
            return str(after)
        self._on_end(CANCELLED)
        local = self._runs.get((owner, response_id))
        if local is not None and local.task is not None:
            local.stop_reason = CANCELLED
            local.task.cancel()  # the engine request is aborted as the relay closes
        return cancelled

    async def streamable(self, owner: str, response_id: str) -> bool:
        """Whether its events were kept (it was created with stream: true and background: true)."""
        run: RunState | None = await self._call(lambda: self.store.run_state(owner, response_id))
        return run is not None and run.events > 0

    def follow(self, owner: str, response_id: str, first: int) -> Response:
        """Its events from sequence number `first`, then live until it ends."""
        return StreamingResponse(self._follow(owner, response_id, first), media_type="text/event-stream",
                                 headers=_SSE_HEADERS)

    async def _follow(self, owner: str, response_id: str, first: int) -> AsyncIterator[bytes]:
        try:
            while True:
                local = self._runs.get((owner, response_id))
                changed = local.changed if local is not None else None
                run: RunState | None = await self._call(lambda: self.store.run_state(owner, response_id))
                if run is None:
                    return  # deleted
                if run.events > first:
                    for event in await self._call(functools.partial(self.store.events, owner, response_id, first,
                                                                    run.events)):
                        yield event
                    first = run.events
                    continue
                if run.state not in RUNNING:
                    return
                if self._stale(owner, response_id, run):
                    stored = await self._call(lambda: self.store.record(owner, response_id))
                    if stored is not None:
                        await self.settle(owner, response_id, stored)
                    continue
                if changed is not None:
                    try:
                        await asyncio.wait_for(changed.wait(), BEAT_S)
                    except TimeoutError:
                        pass
                else:
                    await asyncio.sleep(POLL_S)
        except GatewayError as exc:  # the store failing: the stream ends with an error event, never silently
            yield _frame({"type": "error", "code": exc.code, "message": exc.message, "param": None,
                          "sequence_number": first})


def _failed(response: dict[str, Any], message: str) -> dict[str, Any]:
    return {**response, "status": FAILED, "error": {"code": "server_error", "message": message}}


def _error_message(response: Response) -> str:
    try:
        error = orjson.loads(bytes(response.body)).get("error", {})
        return str(error.get("message") or "The worker refused the request.")
    except (orjson.JSONDecodeError, AttributeError):
        return "The worker refused the request."
