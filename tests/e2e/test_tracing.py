"""OpenTelemetry tracing: off by default (no-op), in-memory exporter in tests, W3C propagation."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

pytest.importorskip("opentelemetry.sdk")

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from deepinfer_gateway.config import GatewaySettings, TracingSettings
from deepinfer_gateway.core import tracing
from deepinfer_gateway.gateway.telemetry.logs import RequestContext, current_request_id
from deepinfer_gateway.workers.mux import SPAN_NAME
from harness.launch import CLI, Gateway, Proc, free_port, wait_for_port


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

    routes = [Route("/v1/chat/completions", hello, methods=["POST"])]
    app = RequestContext(tracing.ServerSpans(Starlette(routes=routes), request_id=lambda _: current_request_id()))
    caller_trace = "4bf92f3577b34da6a3ce929d0e0e4736"
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        r = await client.post("/v1/chat/completions", headers={
            "traceparent": f"00-{caller_trace}-00f067aa0ba902b7-01", "x-request-id": "rid-7"})
        assert r.headers["x-request-id"] == "rid-7"
        await client.get("/health")  # probes get no span
    spans = {s.name: s for s in exporter.get_finished_spans()}
    exporter.clear()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        generated = (await client.post("/v1/chat/completions")).headers["x-request-id"]  # none sent: ours
    unnamed = next(s for s in exporter.get_finished_spans() if s.name == "POST /v1/chat/completions")
    assert unnamed.attributes["dgw.request_id"] == generated
    assert set(spans) == {"POST /v1/chat/completions", "router.choose"}
    root = spans["POST /v1/chat/completions"]
    assert format(root.context.trace_id, "032x") == caller_trace
    assert root.attributes["dgw.request_id"] == "rid-7"
    assert root.attributes["http.response.status_code"] == 200
    assert root.attributes["dgw.worker"] == "w9"
    assert spans["router.choose"].parent.span_id == root.context.span_id


def _console_spans(text: str) -> list[dict]:
    """The JSON objects ConsoleSpanExporter printed, one per span (pretty-printed, back to back)."""
    decoder, spans, pos = json.JSONDecoder(), [], 0
    while (start := text.find("{", pos)) != -1:
        span, pos = decoder.raw_decode(text, start)
        spans.append(span)
    return spans


@pytest.mark.parametrize("command", ["worker", "sim-cluster"])
def test_one_trace_spans_gateway_and_worker_processes(tmp_path: Path, command: str) -> None:
    """A real gateway and a real sim worker (`worker`, or one in a `sim-cluster`), both exporting
    to the console: the worker's server span is a child of the gateway's `worker.generate`
    span, in the same trace."""
    port = free_port()
    gateway_out, worker_out = (tmp_path / "gateway.out").open("wb"), (tmp_path / "worker.out").open("wb")
    where = ["--port", str(port)] if command == "worker" else ["--workers", "unified:sm100", "--base-port", str(port)]
    worker = Proc(CLI + [command, *where, "--time-scale", "50", "--otel-exporter", "console"], stdout=worker_out)
    gateway = None
    try:
        wait_for_port(port, timeout=30)
        gateway = Gateway(tmp_path, [(f"http://127.0.0.1:{port}", "unified", "sm100")], stdout=gateway_out,
                          extra_toml='worker_protocol = "auto"\n[tracing]\nenabled = true\nexporter = "console"\n')
        gateway.wait_ready(1)
        with openai.OpenAI(base_url=gateway.url + "/v1", api_key="t", max_retries=0) as client:
            raw = client.chat.completions.with_raw_response.create(
                model="DeepSeek-V4.1-Flash", max_tokens=4, stream=True,
                messages=[{"role": "user", "content": "trace me"}])
            assert sum(1 for _ in raw.parse()) > 1  # streamed to the end
        request_id = raw.headers["x-request-id"]
    finally:
        if gateway is not None:
            gateway.stop()  # SIGTERM: the span processors flush on the way out
        worker.stop()
        gateway_out.close()
        worker_out.close()
    ours = {s["name"]: s for s in _console_spans((tmp_path / "gateway.out").read_text())}
    theirs = {s["name"]: s for s in _console_spans((tmp_path / "worker.out").read_text())}
    assert {"POST /v1/chat/completions", "router.lookup", "worker.generate", "stream.relay"} <= set(ours), sorted(ours)
    assert ours["POST /v1/chat/completions"]["attributes"]["route.worker"] == f"127.0.0.1:{port}"
    # Polled endpoints get no span; the request came over worker protocol v2's connection.
    assert set(theirs) == {SPAN_NAME}, sorted(theirs)
    served, call = theirs[SPAN_NAME], ours["worker.generate"]
    assert served["context"]["trace_id"] == call["context"]["trace_id"] == ours["POST /v1/chat/completions"][
        "context"]["trace_id"]
    assert served["parent_id"] == call["context"]["span_id"]
    assert served["kind"] == "SpanKind.SERVER"
    assert served["resource"]["attributes"]["service.name"] == "deepinfer-worker"
    # The client's id on the gateway's span; the worker got one of the gateway's, on the call's span.
    assert ours["POST /v1/chat/completions"]["attributes"]["dgw.request_id"] == request_id
    assert served["attributes"]["dgw.request_id"] == call["attributes"]["dgw.request_id"] != request_id
