"""The upstream seam (gateway/upstream/base.py): one adapter per engine kind from one table, the leg
request as the wire carries it, the HTTP library's errors mapped in one place, and no module
outside the adapters asking which engine a worker runs."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest

from deepinfer_gateway.config import WorkerEngine, parse_worker_spec
from deepinfer_gateway.core import protocol as wp
from deepinfer_gateway.core.errors import UpstreamError, UpstreamKind
from deepinfer_gateway.gateway.upstream import base as seam
from deepinfer_gateway.gateway.upstream.base import LegRequest
from deepinfer_gateway.gateway.upstream.http import http_errors
from deepinfer_gateway.gateway.upstream.table import ADAPTERS, Upstreams
from deepinfer_gateway.kvcache.events import PolledKvLog, ZmqKvPublisher
from deepinfer_gateway.recipe_bridge.tokenizer import load_tokenizer

PACKAGE = Path(seam.__file__).resolve().parents[2]


def test_every_engine_kind_has_one_adapter_satisfying_the_protocol() -> None:
    assert set(ADAPTERS) == set(WorkerEngine)
    upstreams = Upstreams(load_tokenizer(None))
    members = [name for name, _ in inspect.getmembers(seam.Upstream) if not name.startswith("_")]
    assert sorted(members) == ["abort", "generate", "kv_source", "probe", "retire"]
    families = set()
    for engine in WorkerEngine:
        upstream = upstreams.upstream(parse_worker_spec({"url": "http://w.test:1", "engine": engine}))
        for name in members:
            assert callable(getattr(upstream, name)), (engine, name)
        families.add(upstream.handoff_family)
    assert len(families) == len(WorkerEngine)  # no two engines continue each other's hand-offs


def test_each_adapter_offers_its_kv_event_source() -> None:
    upstreams = Upstreams(load_tokenizer(None))
    dgw = upstreams.upstream(parse_worker_spec({"url": "http://w.test:1"}))
    assert dgw.kv_source() == PolledKvLog("http://w.test:1")
    vllm = upstreams.upstream(parse_worker_spec({"url": "http://v.test:1", "engine": "vllm",
                                                 "kv_events_endpoint": "tcp://v.test:5557", "kv_events_topic": "t"}))
    source = vllm.kv_source()
    assert isinstance(source, ZmqKvPublisher) and (source.endpoint, source.topic) == ("tcp://v.test:5557", "t")
    assert upstreams.upstream(parse_worker_spec({"url": "http://v.test:1", "engine": "vllm"})).kv_source() is None
    assert upstreams.upstream(parse_worker_spec({"url": "http://o.test:1", "engine": "openai"})).kv_source() is None


def test_the_leg_request_on_the_wire_is_a_generate_request_without_the_prediction() -> None:
    leg = LegRequest("r1", [1, 2, 3], {"max_tokens": 5}, "agent", role=wp.Role.PREFILL, predicted_cached=128,
                     images=["aW1n"], image_token_adjustment=7)
    wire = leg.wire()
    assert "predicted_cached" not in str(wire)
    parsed = wp.GenerateRequest.model_validate(wire)
    assert (parsed.role, parsed.workload_class, parsed.images, parsed.image_token_adjustment) == (
        wp.Role.PREFILL, "agent", ["aW1n"], 7)
    handoff = {"handle": "h", "source_worker": "p", "kv_format": "fp8", "num_tokens": 3}
    decode = leg.decode(handoff, [1, 2, 3, 9])
    assert (decode.role, decode.kv_handoff, decode.token_ids, decode.predicted_cached) == (
        wp.Role.DECODE, handoff, [1, 2, 3, 9], 0)
    assert wp.GenerateRequest.model_validate(decode.wire()).kv_handoff is not None
    assert "images" not in LegRequest("r2", [1], {}).wire()


@pytest.mark.parametrize(("raised", "kind"), [
    (TimeoutError(), UpstreamKind.TIMEOUT),
    (aiohttp.ServerTimeoutError(), UpstreamKind.TIMEOUT),
    (aiohttp.ClientConnectorError(SimpleNamespace(host="w", port=1, ssl=None), OSError(111, "refused")),
     UpstreamKind.CONNECT),
    (aiohttp.ServerDisconnectedError(), UpstreamKind.DISCONNECT),
    (ConnectionResetError(), UpstreamKind.DISCONNECT),
])
def test_http_errors_become_upstream_errors(raised: BaseException, kind: UpstreamKind) -> None:
    with pytest.raises(UpstreamError) as caught, http_errors("http://w:1"):
        raise raised
    assert caught.value.kind == kind
    if kind is UpstreamKind.DISCONNECT:  # a control call says the worker is unreachable
        with pytest.raises(UpstreamError) as control, http_errors("http://w:1", broken=UpstreamKind.CONNECT):
            raise raised
        assert control.value.kind == UpstreamKind.CONNECT


def _engine_tests(path: Path) -> list[str]:
    """Where a module reads `.engine` or names `WorkerEngine` (line numbers)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr == "engine":
            found.append(f"{path.name}:{node.lineno} .engine")
        elif isinstance(node, ast.Name) and node.id == "WorkerEngine":
            found.append(f"{path.name}:{node.lineno} WorkerEngine")
    return found


def test_the_registry_feeder_and_request_path_never_ask_for_the_engine_kind() -> None:
    modules = [PACKAGE / "kvcache" / "events.py"] + [
        p for p in (PACKAGE / "gateway").rglob("*.py")
        if p.stem in {"registry", "legs", "relay", "server", "route_inputs", "app", "admin_sync", "routes"}]
    assert len(modules) == 9
    offenders: list[Any] = [hit for path in modules for hit in _engine_tests(path)]
    assert offenders == []


def test_the_direct_path_is_a_capability_the_transport_declares() -> None:
    """The relay finds v2's direct path through the seam (`direct`), not by a transport's class:
    a stream that does not declare it gets no sink, one that does is handed back as itself."""
    from deepinfer_gateway.gateway.upstream.base import direct
    from deepinfer_gateway.gateway.upstream.mux import MuxStream

    class Plain:
        async def next_event(self) -> None:
            return None

        def buffered(self) -> bool:
            return False

        def close(self) -> None:
            pass

    assert direct(Plain()) is None
    mux = MuxStream(None, "r1")  # type: ignore[arg-type,unused-ignore]  # no connection: not used here
    assert direct(mux) is mux and mux.sink is None
