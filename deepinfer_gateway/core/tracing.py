"""OpenTelemetry tracing of the request path (gateway -> router -> worker), off by default.

Shared by the gateway and the workers (the CLI wires both): a worker wraps its app in
`ServerSpans` too, so its span continues the gateway's `worker.generate` client span.

Optional: `pip install deepinfer-gateway[otel]` (opentelemetry-api and -sdk; add
opentelemetry-exporter-otlp for `exporter = "otlp"`). With tracing off, or the packages
absent, every call here is a no-op costing one attribute check.

    tracing.configure(settings.tracing)           # once per process (cli / lifespan)
    app = tracing.ServerSpans(app)                # root span per HTTP request (SERVER kind)
    with tracing.span("router.lookup", candidates=n):   # child spans on the request path
        ...
    headers = tracing.inject({...})               # W3C traceparent for the worker call

Span names on the request path (a contract for dashboards built on traces):
`POST /v1/chat/completions` (root, server; the route as `route.mode`, `route.worker`,
`route.reason`), `router.lookup` (prompt hashing and the prefix index; `candidates`),
`worker.generate` (client; worker, attempt, role), `stream.relay`, and in the
worker's process `POST /v1/worker/generate` (server, child of `worker.generate`).
Server spans carry `dgw.request_id` so traces and JSON logs join on it.

The provider is this module's, not OpenTelemetry's global one (which can be set only
once per process), so tests can install an in-memory exporter, run, and `shutdown()`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

from deepinfer_gateway.config import TracingSettings
from deepinfer_gateway.core import headers
from deepinfer_gateway.core.protocol import SPANS_SCOPE_KEY

log = logging.getLogger(__name__)


class _NoopSpan:
    """Stands in for a span when tracing is off: accepts and drops everything."""

    __slots__ = ()

    def set_attribute(self, key: str, value: Any) -> None:
        pass

    def set_attributes(self, attributes: dict[str, Any]) -> None:
        pass

    def record_exception(self, exc: BaseException) -> None:
        pass

    def is_recording(self) -> bool:
        return False

    def __enter__(self) -> _NoopSpan:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


NOOP_SPAN = _NoopSpan()
_tracer: Any = None  # opentelemetry Tracer when enabled
_provider: Any = None
_WORKER_HEADER = headers.WORKER.encode()


def enabled() -> bool:
    return _tracer is not None


def configure(settings: TracingSettings, exporter: Any = None) -> bool:
    """Install a tracer for this process; returns whether tracing is on.

    `exporter`: a SpanExporter instance overriding `settings.exporter` (tests pass an
    `InMemorySpanExporter`; it is exported synchronously so assertions see every span).
    """
    global _tracer, _provider
    shutdown()
    if not settings.enabled:
        return False
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import (
            BatchSpanProcessor,
            SimpleSpanProcessor,
        )
        from opentelemetry.sdk.trace.sampling import ParentBasedTraceIdRatio
    except ImportError:
        log.warning("tracing is enabled but opentelemetry-sdk is not installed (pip install "
                    "'deepinfer-gateway[otel]'); tracing stays off")
        return False
    provider = TracerProvider(resource=Resource.create({"service.name": settings.service_name}),
                              sampler=ParentBasedTraceIdRatio(settings.sample_ratio))
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    elif settings.exporter == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    elif settings.exporter == "otlp":
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import (  # type: ignore[import-not-found,unused-ignore]
                OTLPSpanExporter,
            )
        except ImportError:
            log.warning("tracing exporter 'otlp' needs opentelemetry-exporter-otlp-proto-http; tracing stays off")
            provider.shutdown()
            return False
        otlp = OTLPSpanExporter(endpoint=settings.endpoint) if settings.endpoint else OTLPSpanExporter()
        provider.add_span_processor(BatchSpanProcessor(otlp))
    _provider = provider
    _tracer = provider.get_tracer("deepinfer_gateway")
    return True


def shutdown() -> None:
    """Flush and uninstall (process exit, or between tests)."""
    global _tracer, _provider
    if _provider is not None:
        _provider.shutdown()
    _tracer = _provider = None


def span(name: str, *, kind: str = "internal", **attributes: Any) -> AbstractContextManager[Any]:
    """A child span of the current one (a no-op object when tracing is off).

    `kind`: "internal" | "client" | "server". Attributes with value None are dropped.
    Exceptions leaving the block are recorded and set the span's status to ERROR.
    """
    if _tracer is None:
        return NOOP_SPAN
    return _start(name, kind, attributes)


def served_span(name: str, carrier: dict[str, str] | None, **attributes: Any) -> AbstractContextManager[Any]:
    """A SERVER span continuing the caller's W3C context `carrier` (`traceparent`, `tracestate`),
    for work that is not one HTTP request (a request on worker protocol v2's connection)."""
    if _tracer is None:
        return NOOP_SPAN
    from opentelemetry.propagate import extract

    return _start(name, "server", attributes, context=extract(carrier) if carrier else None)


@contextmanager
def _start(name: str, kind: str, attributes: dict[str, Any], context: Any = None) -> Iterator[Any]:
    from opentelemetry.trace import SpanKind

    attrs = {k: v for k, v in attributes.items() if v is not None}
    with _tracer.start_as_current_span(name, context=context, kind=getattr(SpanKind, kind.upper()),
                                       attributes=attrs) as current:
        yield current


def current_span() -> Any:
    """The active span (to add attributes/events after the fact), or the no-op span."""
    if _tracer is None:
        return NOOP_SPAN
    from opentelemetry import trace

    return trace.get_current_span()


def inject(headers: dict[str, str]) -> dict[str, str]:
    """Add the W3C `traceparent` (and `tracestate`) of the current span to `headers`; returns them."""
    if _tracer is not None:
        from opentelemetry.propagate import inject as otel_inject

        otel_inject(headers)
    return headers


def header_request_id(scope: dict[str, Any]) -> str | None:
    """The caller's `x-request-id` (what the gateway sends its workers)."""
    for key, value in scope["headers"]:
        if key == b"x-request-id":
            return str(value.decode("latin-1"))
    return None


class ServerSpans:
    """ASGI middleware: one SERVER span per HTTP request, continuing the client's `traceparent`.

    Paths in `skip` (probes, metrics, polled endpoints) get no span. `request_id(scope)`
    names the request for `dgw.request_id`; the gateway passes its own (generated when the
    client sent none: place this inside `logs.RequestContext`).
    """

    def __init__(self, app: Any, skip: frozenset[str] = frozenset({"/health", "/ready", "/metrics"}),
                 request_id: Callable[[dict[str, Any]], str | None] = header_request_id):
        self.app = app
        self.skip = skip
        self.request_id = request_id

    def __getattr__(self, name: str) -> Any:
        return getattr(self.app, name)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if _tracer is None or scope["type"] != "http" or scope["path"] in self.skip:
            if _tracer is not None and scope["type"] == "websocket":
                # One connection carries many requests (worker protocol v2): each gets its own span.
                scope[SPANS_SCOPE_KEY] = served_span
            await self.app(scope, receive, send)
            return
        from opentelemetry.propagate import extract

        carrier = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]
                   if k in (b"traceparent", b"tracestate")}
        name = f"{scope['method']} {scope['path']}"
        attrs = {"http.request.method": scope["method"], "url.path": scope["path"],
                 "dgw.request_id": self.request_id(scope)}
        with _start(name, "server", attrs, context=extract(carrier) if carrier else None) as root:
            async def send_wrapper(message: dict[str, Any]) -> None:
                if message["type"] == "http.response.start":
                    root.set_attribute("http.response.status_code", message["status"])
                    for key, value in message.get("headers", ()):
                        if key == _WORKER_HEADER:
                            root.set_attribute("dgw.worker", value.decode("latin-1"))
                    if message["status"] >= 500:
                        from opentelemetry.trace import Status, StatusCode

                        root.set_status(Status(StatusCode.ERROR))
                await send(message)

            await self.app(scope, receive, send_wrapper)
