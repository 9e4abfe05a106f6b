"""Worker protocols v1 and v2 (docs/worker-protocol.md) as an `Upstream`: sim and DeepInfer workers.

Legs go over v2 (one multiplexed connection per worker, upstream/mux.py) when the
gateway is set to `worker_protocol = "auto"` and the worker speaks it: the
upgrade is the negotiation, and a worker answering it 404 (v1 only) gets v1 generate
calls until its epoch changes (a restart may bring v2). Over v1 the generate call streams
the worker's events as JSON lines. Health is its info and load endpoints; its KV events
are a log the feeder long-polls (kvcache/events.py). A worker that pushes (v2 with the push
subprotocol) sends both on its connection instead once the registry `start_pushes`: the
registry stops probing it and the feeder stops polling it until the connection closes. A PD hand-off between two such
workers is the worker's own business: the prefill leg's `finish` carries it and the decode
leg sends it back (relay.py follows it).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import orjson

from deepinfer_gateway.config import DgwWorkerSpec
from deepinfer_gateway.core import protocol as wp
from deepinfer_gateway.core.errors import UpstreamError, UpstreamKind
from deepinfer_gateway.gateway.upstream.base import EventStream, LegRequest, LoadListener, Probe, Timeouts
from deepinfer_gateway.gateway.upstream.http import HttpPool, LineStream, Response, http_errors
from deepinfer_gateway.gateway.upstream.mux import MuxConnection, NotSpoken, TooLarge
from deepinfer_gateway.kvcache.events import PolledKvLog
from deepinfer_gateway.kvcache.pushed import KvPush

log = logging.getLogger(__name__)

# Load reports pushed at most this often per worker: the routers' view is at most this stale
# under load (the bookings cover the requests sent since), where probes read it every second.
LOAD_PUSH_INTERVAL_MS = 50


class WorkerStream(LineStream):
    """An open generate call; iterate events (dicts)."""

    def __init__(self, response: Response, timeouts: Timeouts):
        super().__init__(response, timeouts.first_event_s, timeouts.between_events_s)

    async def next_event(self) -> dict[str, Any] | None:
        line = await self.read_line()
        if not line:
            return None
        try:
            event = orjson.loads(line)
        except orjson.JSONDecodeError:
            raise UpstreamError(UpstreamKind.PROTOCOL, f"worker sent a malformed line: {line[:80]!r}") from None
        if not isinstance(event, dict) or "event" not in event:
            raise UpstreamError(UpstreamKind.PROTOCOL, f"worker sent an unknown message: {line[:80]!r}")
        return event


class DgwUpstream:
    """One worker speaking worker protocol v2, or v1 (module doc)."""

    handoff_family = "dgw"

    reports_queue = True

    def __init__(self, spec: DgwWorkerSpec, http: HttpPool):
        self.spec = spec
        self._http = http
        self._mux: MuxConnection | None = None
        self._connecting = asyncio.Lock()
        # The worker's epoch when it answered that it speaks only v1 (None: try v2).
        self._v1_epoch: str | None = None
        self._epoch = ""
        self._kv_push = KvPush()
        self._on_load: LoadListener | None = None
        self._on_down: Callable[[], None] | None = None
        self._push_epoch: str | None = None  # the epoch whose connection did not push
        self._by_priority = False  # the worker schedules by `priority` (its info)

    @property
    def protocol(self) -> int:
        """The protocol its next leg uses, as far as known (2 until the worker refuses it)."""
        return 2 if self._http.mux and self._v1_epoch is None else 1

    async def probe(self, known: wp.WorkerInfo | None) -> Probe:
        """The load report; the info is (re)read when not known and when the worker restarted (new epoch)."""
        url = self.spec.url
        load = wp.LoadReport.model_validate(await self._http.get_json(url, wp.LOAD_PATH))
        if known is None or (load.epoch and load.epoch != known.epoch):
            known = wp.WorkerInfo.model_validate(await self._http.get_json(url, wp.INFO_PATH))
        self._epoch = known.epoch
        self._by_priority = known.scheduling_policy == "priority"
        if self._v1_epoch is not None and self._v1_epoch != known.epoch:
            self._v1_epoch = None  # restarted: it may speak v2 now
        return Probe(known, load)

    async def generate(self, leg: LegRequest) -> EventStream:
        if self._http.mux:
            conn = await self._connection() if self._v1_epoch is None else None
            reason = wp.V1Fallback.NOT_SPOKEN
            if conn is not None:
                try:
                    return await conn.submit(leg, self._by_priority)
                except TooLarge:
                    reason = wp.V1Fallback.TOO_LARGE  # v1 takes it: its body limit is the gateway's own
            self._http.mux_metrics.mux_fallback(self.spec.worker_id, reason)
        return await self._generate_v1(leg)

    async def _connection(self) -> MuxConnection | None:
        """The open v2 connection, opened (again) when there is none, it closed (the worker
        restarted) or the worker token changed; None when the worker speaks only v1."""
        conn = self._mux
        if conn is not None and not conn.closed and conn.auth == self._http.session.headers.get("Authorization"):
            return conn
        async with self._connecting:
            conn = self._mux
            auth = self._http.session.headers.get("Authorization")
            if conn is not None and not conn.closed and conn.auth == auth:
                return conn
            try:
                fresh = await MuxConnection.open(self._http, self.spec.url, self.spec.worker_id,
                                                 reconnect=conn is not None and conn.closed)
            except NotSpoken as exc:
                log.info("worker %s speaks worker protocol v1 only (%s)", self.spec.worker_id, exc)
                self._v1_epoch = self._epoch
                return None
            if conn is not None and not conn.closed:
                conn.retire()  # the token changed: its legs finish on it, new ones go on the new one
            self._mux = fresh
            self._wire_pushes(fresh)
            return fresh

    @property
    def pushes_live(self) -> bool:
        conn = self._mux
        return conn is not None and not conn.closed and conn.pushes and conn.on_load is not None

    @property
    def may_push(self) -> bool:
        return self._http.mux and self._v1_epoch is None and self._push_epoch != self._epoch

    async def start_pushes(self, on_load: LoadListener, on_down: Callable[[], None]) -> None:
        self._on_load, self._on_down = on_load, on_down
        if not self.may_push:
            return  # v1 only, or this epoch's connection said it does not push
        conn = self._mux
        if conn is not None and not conn.closed and conn.on_load is None:
            self._wire_pushes(conn)  # opened by a leg before the registry asked
        await self._connection()

    def _wire_pushes(self, conn: MuxConnection) -> None:
        """Route a fresh connection's pushes to the feeder and the registry, and subscribe."""
        if not conn.pushes:
            if self._push_epoch != self._epoch:
                log.info("worker %s's v2 connection does not push (an older worker, or a proxy dropped the "
                         "subprotocol): its KV events are polled and its load probed over HTTP", self.spec.worker_id)
            self._push_epoch = self._epoch
            return
        on_load = self._on_load
        if on_load is None or conn.closed:
            return  # nobody listens yet (`start_pushes` wires it), or gone already (no `on_shut` would come)
        conn.on_load = on_load
        conn.on_kv_events = self._kv_push.deliver
        conn.on_shut = self._push_ended
        conn.subscribe_load(LOAD_PUSH_INTERVAL_MS)
        self._kv_push.attach(conn.subscribe_kv)

    def _push_ended(self, conn: MuxConnection) -> None:
        self._kv_push.detach(conn.subscribe_kv)
        if self._on_down is not None and self._mux is conn:
            self._on_down()

    async def _generate_v1(self, leg: LegRequest) -> WorkerStream:
        url = self.spec.url
        response = await self._http.post(url, wp.GENERATE_PATH, leg.wire(self._by_priority), leg.request_id)
        if response.status != 200:
            text = (await response.read())[:300].decode(errors="replace")
            response.release()
            retryable = response.status >= 500 or response.status == 429
            raise UpstreamError(UpstreamKind.HTTP_STATUS, f"worker {url} answered {response.status}: {text}",
                                retryable=retryable, status=response.status, detail=text)
        return WorkerStream(response, self._http.timeouts)

    async def abort(self, request_id: str) -> None:
        """Best effort: over v2 an `abort` op (a no-op when the stream's close already sent it);
        over v1 the dropped connection already aborts, and this covers proxies that keep it open."""
        if self._mux is not None and not self._mux.closed:
            self._mux.abort(request_id)
            return
        url = self.spec.url
        try:
            with http_errors(url):
                response = await self._http.post(url, wp.ABORT_PATH, {"request_id": request_id}, request_id,
                                                 control=True)
                async with response:
                    await response.read()
        except UpstreamError:
            pass

    def retire(self) -> None:
        if self._mux is not None:
            self._mux.retire()

    def kv_source(self) -> PolledKvLog:
        return PolledKvLog(self.spec.url, self._kv_push if self._http.mux else None)
