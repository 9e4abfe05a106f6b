"""OpenTelemetry tracing: off by default (no-op), in-memory exporter in tests, W3C propagation."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

pytest.importorskip("opentelemetry.sdk")

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from deepinfer_gateway.config import GatewaySettings, TracingSettings
from deepinfer_gateway.gateway import tracing
from deepinfer_gateway.gateway.logs import RequestContext


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    memory = InMemorySpanExporter()
    assert tracing.configure(TracingSettings(enabled=True), exporter=memory)
    yield memory
    tracing.shutdown()


def test_off_by_default_and_a_no_op() -> None:
    assert GatewaySettings().tracing.enabled is False
    assert not tracing.configure(TracingSettings())
    assert not tracing.enabled()
    with tracing.span("router.choose", pool="p") as s:
        s.set_attribute("x", 1)
    assert s is tracing.NOOP_SPAN
    assert tracing.inject({}) == {}


def test_spans_nest_and_propagate(exporter: InMemorySpanExporter) -> None:
    with tracing.span("gateway", kind="server", request_id="r1"):
        with tracing.span("router.choose", pool="unified", skipped=None) as s:
            s.set_attribute("worker", "w1")
        with tracing.span("worker.generate", kind="client", worker="w1"):
            headers = tracing.inject({"x-request-id": "r1"})
    assert headers["traceparent"].startswith("00-")
    spans = {s.name: s for s in exporter.get_finished_spans()}
    root = spans["gateway"]
    assert spans["router.choose"].parent.span_id == root.context.span_id
    assert spans["router.choose"].attributes == {"pool": "unified", "worker": "w1"}
    assert spans["worker.generate"].context.trace_id == root.context.trace_id
    assert headers["traceparent"].split("-")[1] == format(root.context.trace_id, "032x")


def test_errors_are_recorded(exporter: InMemorySpanExporter) -> None:
    with pytest.raises(RuntimeError), tracing.span("worker.generate"):
        raise RuntimeError("worker died")
    (span,) = exporter.get_finished_spans()
    assert not span.status.is_ok and span.events[0].name == "exception"


async def test_server_spans_continue_the_callers_trace_and_carry_the_request_id(
        exporter: InMemorySpanExporter) -> None:
    async def hello(request: Request) -> PlainTextResponse:
        with tracing.span("router.choose"):
            pass
        return PlainTextResponse("hi", headers={"x-dgw-worker": "w9"})

    app = RequestContext(tracing.ServerSpans(Starlette(routes=[Route("/v1/chat/completions", hello,
                                                                     methods=["POST"])])))
    caller_trace = "4bf92f3577b34da6a3ce929d0e0e4736"
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        r = await client.post("/v1/chat/completions", headers={
            "traceparent": f"00-{caller_trace}-00f067aa0ba902b7-01", "x-request-id": "rid-7"})
        assert r.headers["x-request-id"] == "rid-7"
        await client.get("/health")  # probes get no span
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {"POST /v1/chat/completions", "router.choose"}
    root = spans["POST /v1/chat/completions"]
    assert format(root.context.trace_id, "032x") == caller_trace
    assert root.attributes["dgw.request_id"] == "rid-7"
    assert root.attributes["http.response.status_code"] == 200
    assert root.attributes["dgw.worker"] == "w9"
    assert spans["router.choose"].parent.span_id == root.context.span_id
