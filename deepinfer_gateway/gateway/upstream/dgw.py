"""Worker protocol v1 (docs/worker-protocol.md) as an `Upstream`: sim and DeepInfer workers.

The generate call streams the worker's events as JSON lines; health is its info and load
endpoints; its KV events are a log the feeder long-polls (kvcache/events.py). A PD hand-off
between two such workers is the worker's own business: the prefill leg's `finish` carries
it and the decode leg sends it back (relay.py follows it).
"""

from __future__ import annotations

from typing import Any

import orjson

from deepinfer_gateway import protocol as wp
from deepinfer_gateway.config import DgwWorkerSpec
from deepinfer_gateway.errors import UpstreamError, UpstreamKind
from deepinfer_gateway.gateway.upstream.base import LegRequest, Probe, Timeouts
from deepinfer_gateway.gateway.upstream.http import HttpPool, LineStream, Response, http_errors
from deepinfer_gateway.kvcache.events import PolledKvLog


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
    """One worker speaking worker protocol v1."""

    handoff_family = "dgw"

    reports_queue = True

    def __init__(self, spec: DgwWorkerSpec, http: HttpPool):
        self.spec = spec
        self._http = http

    async def probe(self, known: wp.WorkerInfo | None) -> Probe:
        """The load report; the info is (re)read when not known and when the worker restarted (new epoch)."""
        url = self.spec.url
        load = wp.LoadReport.model_validate(await self._http.get_json(url, wp.LOAD_PATH))
        if known is None or (load.epoch and load.epoch != known.epoch):
            known = wp.WorkerInfo.model_validate(await self._http.get_json(url, wp.INFO_PATH))
        return Probe(known, load)

    async def generate(self, leg: LegRequest) -> WorkerStream:
        url = self.spec.url
        response = await self._http.post(url, wp.GENERATE_PATH, leg.wire(), leg.request_id)
        if response.status != 200:
            text = (await response.read())[:300].decode(errors="replace")
            response.release()
            retryable = response.status >= 500 or response.status == 429
            raise UpstreamError(UpstreamKind.HTTP_STATUS, f"worker {url} answered {response.status}: {text}",
                                retryable=retryable, status=response.status, detail=text)
        return WorkerStream(response, self._http.timeouts)

    async def abort(self, request_id: str) -> None:
        """Best effort: the dropped connection already aborts; this covers proxies that keep it open."""
        url = self.spec.url
        try:
            with http_errors(url):
                response = await self._http.post(url, wp.ABORT_PATH, {"request_id": request_id}, request_id,
                                                 control=True)
                async with response:
                    await response.read()
        except UpstreamError:
            pass

    def kv_source(self) -> PolledKvLog:
        return PolledKvLog(self.spec.url)
