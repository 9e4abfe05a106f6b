"""The upstream seam: one worker as the gateway uses it, whatever engine serves it.

In the spirit of httpx's transports: the registry and the request path hold an `Upstream`
per worker and never ask which engine it runs. An `Upstream`
- `probe(known)`: the worker's info and load report (`Probe`), as the registry's health
  check reads them;
- `generate(leg)`: opens one leg (`LegRequest`) and returns an `EventStream` of worker-protocol
  events (`ready`, `tokens`, `finish`: docs/worker-protocol.md), whatever the engine's wire;
- `abort(request_id)`: best effort (the dropped connection is the abort everywhere);
- `kv_source()`: how the prefix index follows its KV cache (kvcache/events.py), or None;
- `handoff_family`: workers of one family can continue each other's PD hand-offs (a KV
  format names a layout, not the hand-off's wire);
- `reports_queue`: its load reports count the prompts waiting in its queue (the worker
  protocol's `queued_prefill_tokens`); False where the engine exports none (reported 0).

A transport whose worker can push its load reports and KV events (worker protocol v2) is
also a `Pushing` (`pushing(upstream)`): the registry stops probing it while it pushes.

One adapter module per engine kind implements it (dgw.py: worker protocols v1, v2;
vllm.py; openai.py), built from table.ADAPTERS by the worker's
`engine`. Pure types: no HTTP library here (http.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from deepinfer_gateway.config import WorkerSpec
from deepinfer_gateway.core import protocol as wp
from deepinfer_gateway.kvcache.events import KvSource


@dataclass(frozen=True)
class Timeouts:
    connect_s: float = 2.0
    first_event_s: float = 30.0  # ready event: queue wait is the engine's business, but not forever
    between_events_s: float = 120.0  # a long prefill may sit between ready and the first token
    control_s: float = 2.0  # abort, health, load, kv events


class EventStream(Protocol):
    """An open generate call as the request path reads it: worker-protocol events, then None."""

    async def next_event(self) -> dict[str, Any] | None: ...

    def buffered(self) -> bool:
        """True when `next_event` would answer without waiting: an event (or the error that
        ends the stream) is already received. The relay writes to its client when it is False
        and coalesces when True, so True must never be said of an event still to come."""
        ...

    def close(self) -> None: ...


Sink = Callable[[dict[str, Any]], bool]
RELAYED: dict[str, Any] = {"event": "relayed"}  # `hand_back`'s wake-up: the relay's own marker, no worker event


class DirectStream(EventStream, Protocol):
    """An event stream that offers the relay's direct path (worker protocol v2): while the
    relay waits on an empty stream, its `sink` takes each event in the transport reader's own
    call (True: taken); `hand_back` ends that, and the waiting `next_event` returns RELAYED.
    A transport says it offers the path with a true class attribute `direct_path`."""

    sink: Sink | None

    def hand_back(self) -> None: ...


def direct(stream: EventStream) -> DirectStream | None:
    """`stream` as a `DirectStream` when its transport offers the direct path, else None."""
    return stream if getattr(stream, "direct_path", False) else None  # type: ignore[return-value]


@dataclass(frozen=True, slots=True)
class LegRequest:
    """One leg of a request, as the request path asks a worker for it (the worker protocol's
    `GenerateRequest`, plus what the router knows of it)."""

    request_id: str
    token_ids: Sequence[int]  # the prompt's `PackedIds` (written with packed_ids.ids_json), or a list
    sampling: dict[str, Any]  # the wire's: non-default fields only
    workload_class: str = "chat"
    role: wp.Role = wp.Role.UNIFIED
    kv_handoff: dict[str, Any] | None = None  # a decode leg's: the prefill leg's `finish` carried it
    images: list[str] | None = None
    image_token_adjustment: int = 0
    cache_salt: str | None = None  # the request's prefix-cache salt (serving/cache_salt.py)
    priority: int = 0  # its engine priority (flow control's tier), sent to workers that schedule by it
    # The router's predicted cached prompt tokens on the chosen worker. Engines that report
    # their cached count only at the end (vLLM, OpenAI servers) give it as `ready`'s
    # provisional count; not a wire field.
    predicted_cached: int = 0

    def wire(self, by_priority: bool = False) -> dict[str, Any]:
        """The worker protocol's generate body; `priority` only for a worker that schedules by
        it (`by_priority`): one that does not refuses it."""
        body: dict[str, Any] = {"request_id": self.request_id, "token_ids": self.token_ids,
                                "sampling": self.sampling, "workload_class": self.workload_class,
                                "role": str(self.role)}
        if self.kv_handoff is not None:
            body["kv_handoff"] = self.kv_handoff
        if self.images:
            body["images"] = self.images
            body["image_token_adjustment"] = self.image_token_adjustment
        if self.cache_salt is not None:
            body["cache_salt"] = self.cache_salt
        if by_priority and self.priority:
            body["priority"] = self.priority
        return body

    def decode(self, handoff: dict[str, Any], token_ids: Sequence[int] | None = None) -> LegRequest:
        """The decode leg continuing this request from `handoff` (`token_ids`: prompt + the
        prefill's tokens, when it sampled any)."""
        return dataclasses.replace(self, role=wp.Role.DECODE, kv_handoff=handoff, predicted_cached=0,
                                   token_ids=self.token_ids if token_ids is None else token_ids)


class Probe(NamedTuple):
    """One health check's reports."""

    info: wp.WorkerInfo
    load: wp.LoadReport


class Upstream(Protocol):
    """One worker, whatever its engine (module doc)."""

    handoff_family: str
    reports_queue: bool

    async def probe(self, known: wp.WorkerInfo | None) -> Probe:
        """Its reports; `known`: the info read before, which an adapter may keep (None: read it)."""
        ...

    async def generate(self, leg: LegRequest) -> EventStream: ...

    async def abort(self, request_id: str) -> None: ...

    def kv_source(self) -> KvSource | None: ...

    def retire(self) -> None:
        """The worker left the registry: let go of what the adapter holds open for it once its
        legs in flight end (a v2 connection would otherwise ping a worker nobody routes to)."""
        ...


LoadListener = Callable[[wp.LoadReport, float], None]  # (report, loop time it counts requests sent before)


class Pushing(Protocol):
    """An upstream whose worker pushes its load reports over a connection (worker protocol v2)."""

    @property
    def pushes_live(self) -> bool:
        """The connection is up and pushing: load reports arrive without probes."""
        ...

    @property
    def may_push(self) -> bool:
        """Worth asking: not known to be unable to (v1 only, or its connection declined)."""
        ...

    async def start_pushes(self, on_load: LoadListener, on_down: Callable[[], None]) -> None:
        """Open the connection and subscribe (a no-op when it is up or the worker cannot push):
        `on_load` per report, `on_down` once a pushing connection closes."""
        ...


def pushing(upstream: Upstream) -> Pushing | None:
    """`upstream` as a `Pushing` when its transport offers pushes, else None."""
    return upstream if hasattr(upstream, "start_pushes") else None  # type: ignore[return-value]


class MuxMetrics(Protocol):
    """What the gateway counts of its worker protocol v2 connections, per worker id
    (telemetry's GatewayMetrics implements it)."""

    def mux_opened(self, worker: str, reconnect: bool) -> None: ...

    def mux_closed(self, worker: str) -> None: ...

    def mux_coalesced(self, worker: str) -> None: ...

    def mux_fallback(self, worker: str, reason: wp.V1Fallback) -> None: ...


class _Uncounted:
    def mux_opened(self, worker: str, reconnect: bool) -> None:
        pass

    def mux_closed(self, worker: str) -> None:
        pass

    def mux_coalesced(self, worker: str) -> None:
        pass

    def mux_fallback(self, worker: str, reason: wp.V1Fallback) -> None:
        pass


UNCOUNTED: MuxMetrics = _Uncounted()  # a pool built without metrics (tests, tools)


class UpstreamFactory(Protocol):
    """Builds a worker's `Upstream` from its spec (table.Upstreams: by engine kind)."""

    def upstream(self, spec: WorkerSpec) -> Upstream: ...
