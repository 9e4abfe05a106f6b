"""Worker protocol v2 on the gateway: one WebSocket per worker carrying every request.

`MuxConnection` is the gateway's one connection to a worker (docs/worker-protocol.md
"v2"). A leg is a `generate` op sent on it; the worker answers with request-tagged events,
all of one engine step in one message, which the connection's reader task parses once and
hands to each request's `MuxStream`. The relay reads a `MuxStream` as it reads a v1 stream
(`next_event`, `close`): one read per worker per step instead of one per stream per token.

Backpressure: the reader never waits for a stream. Each stream queues at most
MAX_QUEUED_EVENTS events; past that (its client reads slower than the worker produces)
the next `tokens` event is merged into the last queued one. Nothing is dropped, no other
stream on the connection waits, and the lagging client gets its backlog as one chunk
(memory bounded by the request's own output, `max_tokens`); `coalesced` counts merges
(and the pool's MuxMetrics, with connections opened, reopened and closed).

Sink: while a relay waits on an empty queue, the relay's `sink` takes each event in the
reader's own call (one step's chunk is framed and written there), instead of a queue, a
future and a task switch per stream per step; the sink declines what only the relay's task
can handle (`finish`, errors), and `hand_back` wakes the task when the sink needs it.

Timeouts: `between_events_s` per request as in v1 once a request has an event. Before its
first, a request fails after `first_event_s` of the worker's silence: no event for any of
its requests on the connection. A worker that streams other requests' tokens meanwhile is
alive and busy, and this request is queued in its engine: failing it to retry elsewhere
would lose its place in that queue and start it again at the back of another's; it then
waits up to `between_events_s` in all. One timer per connection checks both (`_sweep`)
instead of one per read. A connection that stops answering pings (HEARTBEAT_S) is closed
by aiohttp.

Faults: the connection closing (a worker that died or restarted) fails every stream on
it with a `disconnect` UpstreamError, retryable before the first token as in v1; the next
leg opens a new connection (reconnect). Abort: `close()` before `finish` sends an `abort`
op, batched with the other aborts of the same loop turn; the worker cancels the request
as it does for a dropped v1 connection.

Pushes: the upgrade offers protocol.MUX_PUSH_SUBPROTOCOL; a worker that selects it
(`pushes`) sends its KV event batches and load reports on the connection once subscribed
(`kv_subscribe`, `load_subscribe`), read by the same reader and handed to `on_kv_events`
and `on_load` (docs/worker-protocol.md "Pushes"). A load report carries how many of this
connection's generate ops the worker had read when it was sampled; `on_load` gets with it
the loop time before which every op sent was counted (the registry's "probed at").

Timers: `_sweep` is armed only while streams are open, so an idle connection costs the
heartbeat's ping alone.

Auth: the handshake carries the pool's `Authorization` header. When the worker token
changes (a rotation), the next leg opens a new connection with the new one and the old
connection closes once its last stream ends (`retire`).
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable
from typing import Any

import aiohttp
import orjson

from deepinfer_gateway.core import protocol as wp
from deepinfer_gateway.core import tracing
from deepinfer_gateway.core.errors import UpstreamError, UpstreamKind
from deepinfer_gateway.core.protocol import KvEventBatch, LoadReport
from deepinfer_gateway.gateway.upstream.base import RELAYED, UNCOUNTED, LegRequest, MuxMetrics, Sink, Timeouts
from deepinfer_gateway.gateway.upstream.http import HttpPool, http_errors
from deepinfer_gateway.kvcache.packed_ids import ids_json

log = logging.getLogger(__name__)

MAX_QUEUED_EVENTS = 64  # per stream, before `tokens` events are merged
HEARTBEAT_S = 5.0  # ping period; no pong within half of it closes the connection
# Handshake answers of a worker that does not speak v2 (v1 only): the leg goes over v1.
# 403: what a Starlette app without the route answers (the worker server before v2); a
# worker refusing the token answers 401, and one that could only send 403 gets its 401 on v1.
NOT_SPOKEN = frozenset({400, 403, 404, 405, 426})


class NotSpoken(Exception):
    """The worker refused the upgrade as one that does not serve worker protocol v2."""


class TooLarge(Exception):
    """A generate op over MAX_MUX_MESSAGE_BYTES (e.g. large images): it goes over v1."""


class MuxStream:
    """One leg on a `MuxConnection`: its events in order, then None (a `DirectStream`)."""

    direct_path = True  # upstream/base.py's DirectStream: the relay may set `sink`

    __slots__ = ("request_id", "_conn", "_events", "_waiter", "_error", "_got_any", "wait_since", "finished", "sink")

    def __init__(self, conn: MuxConnection, request_id: str):
        self.request_id = request_id
        self._conn = conn
        self._events: collections.deque[dict[str, Any]] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None
        self._error: UpstreamError | None = None
        self._got_any = False
        self.wait_since = 0.0  # loop time the current wait began (the connection's sweep reads it)
        self.finished = False  # `finish` received: nothing more will come
        # Set by the relay: takes an event in the reader's own call while the relay waits on an
        # empty queue (True: done with it), so a step's chunk needs no task switch (module doc).
        self.sink: Sink | None = None

    # -- the reader's side ------------------------------------------------------------

    def push(self, event: dict[str, Any]) -> None:
        events = self._events
        if not events:
            sink, waiter = self.sink, self._waiter
            if sink is not None and waiter is not None and not waiter.done() and sink(event):
                self._got_any = True
                self.wait_since = self._conn.loop.time()  # the relay's wait goes on: its timeout restarts
                return
        if len(events) >= MAX_QUEUED_EVENTS and event["event"] == "tokens" and _merge(events[-1], event):
            conn = self._conn
            conn.coalesced += 1
            conn.metrics.mux_coalesced(conn.worker)
        else:
            events.append(event)
        self._got_any = True
        self._wake()

    def fail(self, error: UpstreamError) -> None:
        if self._error is None and not self.finished:
            self._error = error
            self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- the relay's side -------------------------------------------------------------

    async def next_event(self) -> dict[str, Any] | None:
        events = self._events
        while True:
            if events:
                return events.popleft()
            if self._error is not None:
                raise self._error
            if self.finished:
                return None
            loop = self._conn.loop
            self._waiter = waiter = loop.create_future()
            self.wait_since = loop.time()
            try:
                await waiter
            finally:
                self._waiter = None

    def buffered(self) -> bool:
        """An event (or the error ending the stream) is in hand: `next_event` will not wait."""
        return bool(self._events) or self._error is not None

    @property
    def waiting(self) -> bool:
        return self._waiter is not None

    @property
    def got_any(self) -> bool:
        return self._got_any

    def hand_back(self) -> None:
        """The sink hands the stream back to the relay's task: no more sink, and the waiting
        `next_event` returns a `relayed` event (the relay's own marker, never a worker's)."""
        self.sink = None
        self._events.append(RELAYED)
        self._wake()

    def close(self) -> None:
        """The relay is done with it: before `finish` that is an abort (sent to the worker)."""
        self.sink = None
        if not self.finished:
            self.finished = True
            self._conn.abort(self.request_id)


def _merge(last: dict[str, Any], event: dict[str, Any]) -> bool:
    """Append `event`'s tokens to the queued `last` tokens event, when both carry the same
    fields (token ids, and logprobs when asked for); False when they cannot be merged."""
    if last["event"] != "tokens" or last.keys() != event.keys():
        return False
    for key, value in event.items():
        if key != "event":
            if not isinstance(value, list):
                return False
            last[key] = last[key] + value
    return True


class MuxConnection:
    """The gateway's v2 connection to one worker (module doc)."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse, url: str, timeouts: Timeouts, auth: str | None,
                 worker: str = "", metrics: MuxMetrics = UNCOUNTED):
        """`worker`: the worker id its `metrics` are labelled with."""
        self.url = url
        self.auth = auth  # the Authorization header it was opened with
        self.worker = worker
        self.metrics = metrics
        self.loop = asyncio.get_running_loop()
        self.coalesced = 0  # `tokens` events merged into a lagging stream's queue
        self.messages = 0  # worker messages read
        self.progress_at = 0.0  # loop time of the last message carrying a request's event (the engine moves)
        self._ws = ws
        self._timeouts = timeouts
        self._streams: dict[str, MuxStream] = {}
        self._aborts: list[dict[str, Any]] = []
        self._closed = False
        self._retiring = False
        self._background: set[asyncio.Task[None]] = set()
        # Pushes (module doc): negotiated by the upgrade, consumed by whoever the adapter wires.
        self.pushes = ws.protocol == wp.MUX_PUSH_SUBPROTOCOL
        self.on_kv_events: Callable[[int, KvEventBatch], None] | None = None
        self.on_load: Callable[[LoadReport, float], None] | None = None
        self.on_shut: Callable[[MuxConnection], None] | None = None
        self._ops_sent = 0
        self._op_times: collections.deque[tuple[int, float]] = collections.deque()  # (op number, sent at)
        self._reader = asyncio.create_task(self._read())
        self._sweep_s = min(1.0, max(0.05, min(timeouts.first_event_s, timeouts.between_events_s) / 4))
        self._sweeper: asyncio.TimerHandle | None = None

    @classmethod
    async def open(cls, http: HttpPool, url: str, worker: str = "", reconnect: bool = False) -> MuxConnection:
        """Connect; NotSpoken when the worker serves only v1, UpstreamError when it cannot be reached
        or refuses (401: the worker token). `reconnect`: an earlier connection to it closed
        (counted as such in the pool's metrics)."""
        auth = http.session.headers.get("Authorization")
        with http_errors(url, broken=UpstreamKind.CONNECT):
            try:
                # The upgrade's answer within the first-event timeout: a worker that accepts
                # connections but never answers must not hold every leg waiting for it.
                async with asyncio.timeout(http.timeouts.first_event_s):
                    # compress=0: no permessage-deflate. aiohttp offers it by default and uvicorn
                    # accepts it, so every step message was deflated by the worker and inflated
                    # here: CPU on both sides for bytes that cross a datacenter link or loopback.
                    ws = await http.session.ws_connect(
                        url + wp.MUX_PATH, heartbeat=HEARTBEAT_S, max_msg_size=wp.MAX_MUX_MESSAGE_BYTES, autoping=True,
                        compress=0, protocols=(wp.MUX_PUSH_SUBPROTOCOL,),
                        timeout=aiohttp.ClientWSTimeout(ws_receive=None, ws_close=http.timeouts.control_s))
            except aiohttp.WSServerHandshakeError as exc:
                if exc.status in NOT_SPOKEN:
                    raise NotSpoken(f"{url} answered {exc.status} to the v2 upgrade") from None
                raise UpstreamError(UpstreamKind.HTTP_STATUS, f"worker {url} refused the v2 connection: {exc.status}",
                                    retryable=exc.status >= 500 or exc.status == 429, status=exc.status) from None
        http.mux_metrics.mux_opened(worker, reconnect)
        return cls(ws, url, http.timeouts, auth, worker, http.mux_metrics)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def streams(self) -> int:
        return len(self._streams)

    async def submit(self, leg: LegRequest, by_priority: bool = False) -> MuxStream:
        rid = leg.request_id
        if self._closed:
            raise UpstreamError(UpstreamKind.DISCONNECT, f"connection to {self.url} closed")
        if rid in self._streams:
            raise UpstreamError(UpstreamKind.PROTOCOL, f"request {rid} is already open on {self.url}", retryable=False)
        data = ids_json([wp.generate_op(leg.wire(by_priority), tracing.inject({}))])
        if len(data) > wp.MAX_MUX_MESSAGE_BYTES:
            raise TooLarge(f"a {len(data)}-byte generate op")
        stream = self._streams[rid] = MuxStream(self, rid)
        if self._sweeper is None:
            self._sweeper = self.loop.call_later(self._sweep_s, self._sweep)
        self._ops_sent += 1
        if self.on_load is not None:
            self._op_times.append((self._ops_sent, self.loop.time()))
        try:
            with http_errors(self.url):
                await self._ws.send_bytes(data)
        except BaseException:
            self._streams.pop(rid, None)
            raise
        return stream

    def subscribe_kv(self, after: int, sub: int, interval_ms: int, limit: int) -> bool:
        """Ask for the KV event log from `after` (kvcache/pushed.py's Subscribe); False if closed."""
        return self._send_op(wp.kv_subscribe_op(after, sub, interval_ms, limit))

    def subscribe_load(self, interval_ms: int) -> bool:
        return self._send_op(wp.load_subscribe_op(interval_ms))

    def _send_op(self, op: dict[str, Any]) -> bool:
        if self._closed:
            return False
        self._spawn(self._send_quietly(orjson.dumps([op])))
        return True

    def abort(self, request_id: str) -> None:
        """Abort a request still open on this connection (idempotent); sent with the other aborts
        of this loop turn in one message."""
        if self._streams.pop(request_id, None) is None or self._closed:
            return
        if not self._aborts:
            self._spawn(self._send_aborts())
        self._aborts.append(wp.abort_op(request_id))
        self._close_if_retired()

    def retire(self) -> None:
        """No new legs: close once the open ones end (the worker token changed)."""
        self._retiring = True
        self._close_if_retired()

    def close(self) -> None:
        if not self._closed:
            self._spawn(self._ws.close())

    async def _send_aborts(self) -> None:
        await asyncio.sleep(0)  # let the loop turn's other aborts join this message
        ops, self._aborts = self._aborts, []
        await self._send_quietly(orjson.dumps(ops))

    async def _send_quietly(self, data: bytes) -> None:
        try:
            await self._ws.send_bytes(data)
        except (aiohttp.ClientError, ConnectionError, RuntimeError):
            pass  # the connection is gone: the worker aborts everything that was on it

    def _close_if_retired(self) -> None:
        if self._retiring and not self._streams and not self._aborts:
            self.close()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _read(self) -> None:
        ws = self._ws
        reason = "closed by the worker"
        kind = UpstreamKind.DISCONNECT
        try:
            while True:
                msg = await ws.receive()
                if msg.type is aiohttp.WSMsgType.BINARY or msg.type is aiohttp.WSMsgType.TEXT:
                    self.messages += 1
                    self._dispatch(msg.data)
                    continue
                if msg.type is aiohttp.WSMsgType.ERROR:
                    reason = f"broke: {ws.exception()}"
                elif msg.type is aiohttp.WSMsgType.CLOSE:
                    reason = f"closed by the worker ({msg.data} {msg.extra or ''})".rstrip()
                break
        except UpstreamError as exc:
            # Shut before the close handshake: no leg may be sent on it meanwhile.
            self._shut(str(exc), exc.kind)
            await ws.close()
        except asyncio.CancelledError:
            reason = "closed by the gateway"
            raise
        finally:
            if not self._closed:
                self._shut(reason, kind)

    def _dispatch(self, data: bytes | str) -> None:
        """One worker message: `[[request_id, event], ...]`, each event to its stream."""
        try:
            frames = orjson.loads(data)
            if type(frames) is dict:
                self._pushed(frames)
                return
            streams = self._streams
            self.progress_at = self.loop.time()
            for rid, event in frames:
                stream = streams.get(rid)
                if stream is None:
                    continue  # aborted or closed here meanwhile
                if event["event"] == "finish":
                    del streams[rid]
                    stream.push(event)
                    stream.finished = True
                    if self._retiring:
                        self._close_if_retired()
                else:
                    stream.push(event)
        except (orjson.JSONDecodeError, TypeError, ValueError, KeyError) as exc:
            raise UpstreamError(UpstreamKind.PROTOCOL, f"worker sent a malformed v2 message ({exc}): "
                                f"{bytes(data[:80]) if isinstance(data, bytes) else data[:80]!r}") from None

    def _pushed(self, message: dict[str, Any]) -> None:
        """A push (module doc); one the connection did not ask for is a protocol error."""
        kind = message.get("push")
        if kind == "kv_events" and self.on_kv_events is not None:
            self.on_kv_events(int(message["sub"]), KvEventBatch.model_validate(message["batch"]))
        elif kind == "load" and self.on_load is not None:
            report = LoadReport.model_validate(message["report"])
            seen, times = int(message["ops"]), self._op_times
            while times and times[0][0] <= seen:
                times.popleft()
            # Every op sent before the first one the worker had not read is counted.
            self.on_load(report, times[0][1] - 1e-6 if times else self.loop.time())
        else:
            raise ValueError(f"unexpected push {kind!r}")

    def _shut(self, reason: str, kind: UpstreamKind) -> None:
        """The connection is over: every open stream fails (retryable before its first token)."""
        self._closed = True
        self.metrics.mux_closed(self.worker)
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        streams, self._streams = self._streams, {}
        if streams:
            log.warning("v2 connection to %s %s: %d request(s) failed", self.url, reason, len(streams))
        for stream in streams.values():
            stream.fail(UpstreamError(kind, f"worker connection lost: {reason}"))
        if self.on_shut is not None:
            self.on_shut(self)

    def _sweep(self) -> None:
        """Time out streams whose worker has been silent too long (module doc)."""
        if self._closed:
            return
        now = self.loop.time()
        first_s, between_s = self._timeouts.first_event_s, self._timeouts.between_events_s
        for stream in list(self._streams.values()):
            if not stream.waiting:
                continue
            waited = now - stream.wait_since
            if stream.got_any:
                if waited >= between_s:
                    stream.fail(UpstreamError(UpstreamKind.TIMEOUT, f"no event from worker within {between_s}s"))
            elif now - max(stream.wait_since, self.progress_at) >= first_s:
                stream.fail(UpstreamError(UpstreamKind.TIMEOUT, f"no event from worker within {first_s}s"))
            elif waited >= max(first_s, between_s):
                stream.fail(UpstreamError(UpstreamKind.TIMEOUT, f"not scheduled by its busy worker within "
                                                               f"{max(first_s, between_s)}s"))
        # Re-armed while streams are open; the next submit arms it again.
        self._sweeper = self.loop.call_later(self._sweep_s, self._sweep) if self._streams else None
