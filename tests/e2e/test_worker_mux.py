"""Worker protocol v2: the gateway's one connection per worker (gateway/upstream/mux.py) against the
real worker server (workers/server.py, workers/mux.py) on loopback, for the sim engine and the
DeepInfer wrapper (with its interface double): legs share one connection and one message per
engine step, aborts reach the engine, a slow reader stalls nobody, a restarted worker is
reconnected, the worker token guards the connection, and bad ops get protocol errors. The
gateway's v2 metrics (open connections, reconnects, merged events, v1 fallbacks) are read from
a real GatewayMetrics registry where a test produces them."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from fastapi import FastAPI

from deepinfer_gateway.config import DgwWorkerSpec
from deepinfer_gateway.core import protocol as wp
from deepinfer_gateway.core.errors import UpstreamError, UpstreamKind
from deepinfer_gateway.core.worker_auth import SecretTokens
from deepinfer_gateway.gateway.telemetry.metrics import GatewayMetrics
from deepinfer_gateway.gateway.upstream import mux
from deepinfer_gateway.gateway.upstream.base import LegRequest, Timeouts
from deepinfer_gateway.gateway.upstream.dgw import DgwUpstream, WorkerStream
from deepinfer_gateway.gateway.upstream.http import HttpPool
from deepinfer_gateway.gateway.upstream.mux import MuxStream
from deepinfer_gateway.infra.asgi import ServedApp, serve_app
from deepinfer_gateway.workers.deepinfer import DeepInferConfig, DeepInferEngine, MemoryKvStore
from deepinfer_gateway.workers.engine import Engine
from deepinfer_gateway.workers.server import create_worker_app
from deepinfer_gateway.workers.sim.engine import SimEngine
from deepinfer_gateway.workers.sim.profiles import load_profile
from tests.deepinfer_double import DoubleKvTransfer, core
from tests.fault_doubles import make_double

RATE = 200.0  # sim tokens/s per stream at any batch: 5 ms steps
FLAT = replace(load_profile("sm100"), dp_ranks=1, gpus_per_instance=1, decode_points=((1, RATE), (1024, RATE)))


def sim_engine() -> Engine:
    return SimEngine(worker_id="sim-0", profile=FLAT)


def deepinfer_engine() -> Engine:
    config = DeepInferConfig(model="/m", role=wp.Role.UNIFIED, worker_id="di-0", drain_timeout_s=0)
    return DeepInferEngine(config, api_root="tests.deepinfer_double", kv_store=MemoryKvStore(),
                           kv_transfer=DoubleKvTransfer())


ENGINES: dict[str, Callable[[], Engine]] = {"sim": sim_engine, "deepinfer": deepinfer_engine}


@pytest.fixture(params=sorted(ENGINES))
async def engine(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Engine:
    monkeypatch.setattr(core, "STEP_DELAY_S", 0.005)
    return ENGINES[request.param]()


async def serve(app: FastAPI, port: int = 0) -> ServedApp:
    return await serve_app(app, port=port)


async def pool(tokens: SecretTokens | None = None, timeouts: Timeouts = Timeouts(), mux: bool = True,
               metrics: GatewayMetrics | None = None) -> HttpPool:
    """`metrics`: counts the v2 connections of workers admitted to it (`registered`)."""
    http = HttpPool(timeouts, tokens=tokens, mux=mux) if metrics is None else HttpPool(
        timeouts, tokens=tokens, mux=mux, mux_metrics=metrics)
    await http.start()
    return http


def registered(metrics: GatewayMetrics, upstream: DgwUpstream) -> str:
    """The worker's id, admitted to `metrics` as the registry admits a worker."""
    metrics.admit_worker(upstream.spec.worker_id, "unified")
    return upstream.spec.worker_id


async def until_closed(upstream: DgwUpstream, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while upstream._mux is not None and not upstream._mux.closed:
        assert time.monotonic() < deadline, "the v2 connection stayed open"
        await asyncio.sleep(0.02)


def sample(metrics: GatewayMetrics, name: str, worker: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, {"worker": worker, **labels})


def leg(rid: str, max_tokens: int = 20, prompt: int = 0) -> LegRequest:
    return LegRequest(rid, list(range(100 + prompt, 164 + prompt)), {"max_tokens": max_tokens, "ignore_eos": True})


async def read_all(stream: Any) -> list[dict[str, Any]]:
    events = []
    while (event := await stream.next_event()) is not None:
        events.append(event)
        if event["event"] == "finish":
            break
    return events


def token_ids(events: list[dict[str, Any]]) -> list[int]:
    return [t for e in events if e["event"] == "tokens" for t in e["token_ids"]]


async def load(http: HttpPool, url: str) -> dict[str, Any]:
    return dict(await http.get_json(url, wp.LOAD_PATH))


async def until_idle(http: HttpPool, url: str, timeout: float = 5.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        report = await load(http, url)
        if report["running"] == 0 and report["waiting"] == 0 or time.monotonic() > deadline:
            return report
        await asyncio.sleep(0.02)


@pytest.fixture
async def worker(engine: Engine) -> AsyncIterator[ServedApp]:
    served = await serve(create_worker_app(engine))
    yield served
    await served.stop()


async def test_legs_share_one_connection_one_message_per_step_same_tokens_as_v1(worker: ServedApp) -> None:
    http, v1 = await pool(), await pool(mux=False)
    try:
        upstream = DgwUpstream(DgwWorkerSpec(url=worker.url), http)
        streams = [await upstream.generate(leg(f"m{i}", prompt=i)) for i in range(8)]
        assert all(isinstance(s, MuxStream) for s in streams) and upstream.protocol == 2
        results = await asyncio.gather(*(read_all(s) for s in streams))
        conn = upstream._mux
        assert conn is not None and conn.streams == 0
        events = sum(len(r) for r in results)
        # 8 streams of ready + 20 tokens + finish: the worker batched each step's events of all streams
        assert conn.messages <= events / 3, (conn.messages, events)
        old = DgwUpstream(DgwWorkerSpec(url=worker.url), v1)
        for i, events_v2 in enumerate(results):
            assert events_v2[0]["event"] == "ready" and events_v2[-1]["reason"] == "length"
            assert len(token_ids(events_v2)) == 20
            stream_v1 = await old.generate(leg(f"o{i}", prompt=i))
            assert isinstance(stream_v1, WorkerStream)
            assert token_ids(await read_all(stream_v1)) == token_ids(events_v2)
        assert (await until_idle(http, worker.url))["running"] == 0
    finally:
        await http.close()
        await v1.close()


async def test_abort_on_close_frees_the_engine_and_spares_the_other_streams(worker: ServedApp) -> None:
    http = await pool()
    try:
        upstream = DgwUpstream(DgwWorkerSpec(url=worker.url), http)
        doomed = await upstream.generate(leg("doomed", max_tokens=100_000))
        other = await upstream.generate(leg("other", max_tokens=40, prompt=1))
        assert (await doomed.next_event())["event"] == "ready"
        assert (await doomed.next_event())["event"] == "tokens"
        doomed.close()  # the client went away
        await upstream.abort("doomed")  # the lease's explicit abort: already sent, a no-op
        events = await read_all(other)
        assert events[-1]["reason"] == "length" and len(token_ids(events)) == 40
        report = await until_idle(http, worker.url)
        assert (report["running"], report["waiting"]) == (0, 0), report
        assert upstream._mux is not None and not upstream._mux.closed
    finally:
        await http.close()


async def test_a_retired_worker_keeps_its_leg_in_flight_then_its_connection_closes(worker: ServedApp) -> None:
    """A worker the registry forgets (`retire`) must not keep a v2 connection pinging it; the
    leg on it when it left still ends normally."""
    http = await pool()
    try:
        upstream = DgwUpstream(DgwWorkerSpec(url=worker.url), http)
        running = await upstream.generate(leg("running", max_tokens=40))
        assert (await running.next_event())["event"] == "ready"
        upstream.retire()
        events = await read_all(running)
        assert events[-1]["reason"] == "length" and len(token_ids(events)) == 40
        running.close()
        await until_closed(upstream)
    finally:
        await http.close()


async def test_a_slow_reader_stalls_no_other_stream_and_loses_nothing(worker: ServedApp,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mux, "MAX_QUEUED_EVENTS", 8)  # overflow within a short stream, whatever tokens per step
    metrics = GatewayMetrics()
    http = await pool(metrics=metrics)
    try:
        upstream = DgwUpstream(DgwWorkerSpec(url=worker.url), http)
        worker_id = registered(metrics, upstream)
        slow = await upstream.generate(leg("slow", max_tokens=120))
        fast = await upstream.generate(leg("fast", max_tokens=120, prompt=1))
        # Nobody reads `slow` meanwhile: were the connection's reader to wait for it, this would hang.
        fast_events = await asyncio.wait_for(read_all(fast), 30)
        assert len(token_ids(fast_events)) == 120
        assert isinstance(slow, MuxStream)
        await asyncio.sleep(0.2)
        queued = len(slow._events)
        assert queued <= 8 + 2, queued
        assert slow.buffered()
        assert upstream._mux is not None and upstream._mux.coalesced > 0
        merged = sample(metrics, "dgw_worker_v2_coalesced_events_total", worker_id)
        assert merged == upstream._mux.coalesced
        slow_events = await read_all(slow)
        assert slow_events[-1]["reason"] == "length" and len(token_ids(slow_events)) == 120
        assert slow_events[0]["event"] == "ready"
    finally:
        await http.close()


async def test_a_restarted_worker_fails_its_open_streams_then_is_reconnected(engine: Engine) -> None:
    served = await serve(create_worker_app(engine))
    metrics = GatewayMetrics()
    http = await pool(metrics=metrics)
    try:
        upstream = DgwUpstream(DgwWorkerSpec(url=served.url), http)
        worker_id = registered(metrics, upstream)
        stream = await upstream.generate(leg("cut", max_tokens=100_000))
        assert (await stream.next_event())["event"] == "ready"
        first = upstream._mux
        assert sample(metrics, "dgw_worker_v2_connections", worker_id) == 1
        assert not sample(metrics, "dgw_worker_v2_reconnects_total", worker_id)
        await served.stop()  # the worker goes away mid-stream
        with pytest.raises(UpstreamError) as failed:
            while await stream.next_event():
                pass
        assert failed.value.kind is UpstreamKind.DISCONNECT and failed.value.retryable
        assert sample(metrics, "dgw_worker_v2_connections", worker_id) == 0
        with pytest.raises(UpstreamError) as refused:
            await upstream.generate(leg("down"))
        assert refused.value.kind is UpstreamKind.CONNECT and refused.value.retryable
        served = await serve(create_worker_app(ENGINES["sim"]()), port=served.port)
        events = await read_all(await upstream.generate(leg("back")))
        assert events[-1]["reason"] == "length"
        assert upstream._mux is not first and upstream.protocol == 2
        assert sample(metrics, "dgw_worker_v2_connections", worker_id) == 1
        assert sample(metrics, "dgw_worker_v2_reconnects_total", worker_id) == 1
        metrics.forget_worker(worker_id)  # removed from the registry: its connection closing later adds no series
        await served.stop()
        await until_closed(upstream)
        assert sample(metrics, "dgw_worker_v2_connections", worker_id) is None
    finally:
        await http.close()
        await served.stop()


async def test_the_worker_token_guards_the_connection_and_a_rotation_moves_to_a_new_one(
        engine: Engine, tmp_path: Path) -> None:
    token_file = tmp_path / "tokens"
    token_file.write_text("old-token\n")
    served = await serve(create_worker_app(engine, tokens=SecretTokens(path=token_file, recheck_s=0)))
    anonymous = await pool()
    gateway_file = tmp_path / "gateway-tokens"
    gateway_file.write_text("old-token\n")
    gateway_tokens = SecretTokens(path=gateway_file, recheck_s=0)
    http = await pool(gateway_tokens)
    try:
        with pytest.raises(UpstreamError) as refused:
            await DgwUpstream(DgwWorkerSpec(url=served.url), anonymous).generate(leg("anon"))
        assert refused.value.status == 401 and not refused.value.retryable
        upstream = DgwUpstream(DgwWorkerSpec(url=served.url), http)
        running = await upstream.generate(leg("before", max_tokens=60))
        first = upstream._mux
        # Rotation, worker side first: it accepts both, then only the new one.
        token_file.write_text("new-token\nold-token\n")
        async with aiohttp.ClientSession(headers={"Authorization": "Bearer old-token"}) as session, \
                session.ws_connect(served.url + wp.MUX_PATH) as stale:
            gateway_file.write_text("new-token\n")
            http.session.headers.update({"Authorization": f"Bearer {gateway_tokens.current()}"})
            after = await upstream.generate(leg("after", prompt=1))
            assert upstream._mux is not first and first is not None
            token_file.write_text("new-token\n")
            assert (await read_all(after))[-1]["reason"] == "length"
            assert (await read_all(running))[-1]["reason"] == "length"  # finished on the old connection
            await asyncio.sleep(0.1)
            assert first.closed  # retired once its last stream ended
            # A connection opened with a token since revoked takes no new request...
            await stale.send_bytes(orjson.dumps([wp.generate_op(leg("stale").wire())]))
            frames = orjson.loads((await stale.receive(timeout=5)).data)
            assert frames[0][0] == "stale" and frames[0][1]["error"]["kind"] == "unauthorized"
        # ... and a new one with it is refused at the handshake.
        async with aiohttp.ClientSession(headers={"Authorization": "Bearer old-token"}) as session:
            with pytest.raises(aiohttp.WSServerHandshakeError) as handshake:
                await session.ws_connect(served.url + wp.MUX_PATH)
            assert handshake.value.status == 401
    finally:
        await anonymous.close()
        await http.close()
        await served.stop()


async def test_bad_ops_get_protocol_errors_and_never_reach_the_engine(worker: ServedApp) -> None:
    async with aiohttp.ClientSession() as session, session.ws_connect(worker.url + wp.MUX_PATH) as ws:
        await ws.send_bytes(orjson.dumps([
            wp.generate_op({"request_id": "empty", "token_ids": []}),
            wp.generate_op({"request_id": "extra", "token_ids": [1], "surprise": 1}),
            wp.generate_op(leg("dup", max_tokens=5).wire()),
            wp.generate_op(leg("dup", max_tokens=5).wire()),
            wp.abort_op("never-seen"),
        ]))
        finishes: dict[str, list[dict[str, Any]]] = {}
        while len(finishes.get("dup", [])) < 2 or "empty" not in finishes or "extra" not in finishes:
            for rid, event in orjson.loads((await ws.receive(timeout=5)).data):
                if event["event"] == "finish":
                    finishes.setdefault(rid, []).append(event)
        assert finishes["empty"][0]["error"]["kind"] == "invalid_request"
        assert "token_ids" in finishes["empty"][0]["error"]["message"]
        assert finishes["extra"][0]["error"]["kind"] == "invalid_request"
        assert sorted(e["reason"] for e in finishes["dup"]) == ["error", "length"]
        await ws.send_bytes(b"not json")
        closing = await ws.receive(timeout=5)
        assert closing.type is aiohttp.WSMsgType.CLOSE and closing.data == 1007


class Stalling:
    """An engine whose requests named `stuck*` never get an event (a stalled engine); records
    the ones whose iterator was closed (the worker's abort)."""

    def __init__(self, inner: Engine):
        self.inner = inner
        self.closed: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def generate(self, request: wp.GenerateRequest) -> AsyncIterator[dict[str, Any]]:
        if not request.request_id.startswith("stuck"):
            async for event in self.inner.generate(request):
                yield event
            return
        try:
            await asyncio.Event().wait()
            yield {}
        finally:
            self.closed.append(request.request_id)


async def _timed_out_after(stalling: Stalling, stream: Any) -> tuple[float, str]:
    """Reads `stream` until it times out: (seconds it took, the error's detail); then closes it
    as the lease does and waits for the engine to see the abort."""
    started = time.perf_counter()
    with pytest.raises(UpstreamError) as timed_out:
        while await stream.next_event():
            pass
    took = time.perf_counter() - started
    assert timed_out.value.kind is UpstreamKind.TIMEOUT and timed_out.value.retryable
    stream.close()
    for _ in range(100):
        if stalling.closed:
            break
        await asyncio.sleep(0.05)
    assert stalling.closed == [stream.request_id]
    return took, str(timed_out.value)


async def test_a_silent_engine_times_the_stream_out_and_aborts_it(engine: Engine) -> None:
    stalling = Stalling(engine)
    served = await serve(create_worker_app(stalling))
    http = await pool(timeouts=Timeouts(first_event_s=1.0, between_events_s=3.0))
    try:
        upstream = DgwUpstream(DgwWorkerSpec(url=served.url), http)
        took, detail = await _timed_out_after(stalling, await upstream.generate(leg("stuck-1")))
        assert 0.95 <= took < 2.5 and "within 1.0s" in detail
    finally:
        await http.close()
        await served.stop()


async def test_a_request_queued_behind_other_streams_waits_longer_for_its_first_event(engine: Engine) -> None:
    """While its worker streams other requests' tokens the engine is alive and busy: a request not
    scheduled yet keeps its place past first_event_s, up to between_events_s, then fails."""
    stalling = Stalling(engine)
    served = await serve(create_worker_app(stalling))
    http = await pool(timeouts=Timeouts(first_event_s=1.0, between_events_s=3.0))
    try:
        upstream = DgwUpstream(DgwWorkerSpec(url=served.url), http)
        stream = await upstream.generate(leg("stuck-1"))
        other = await upstream.generate(leg("busy", max_tokens=1000))  # 5 s of tokens
        took, detail = await _timed_out_after(stalling, stream)
        assert 2.95 <= took < 4.5 and "not scheduled" in detail
        assert (await read_all(other))[-1]["reason"] == "length"
    finally:
        await http.close()
        await served.stop()


async def test_a_v1_only_worker_gets_v1_legs() -> None:
    from aiohttp import web

    runner = web.AppRunner(make_double("ok", after=3, tokens=5, delay_s=0.001, hardware="sm100"))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    metrics = GatewayMetrics()
    http = await pool(metrics=metrics)
    try:
        upstream = DgwUpstream(DgwWorkerSpec(url=f"http://127.0.0.1:{port}"), http)
        worker_id = registered(metrics, upstream)
        for rid in ("v1-a", "v1-b"):  # the second goes straight to v1
            stream = await upstream.generate(leg(rid))
            assert isinstance(stream, WorkerStream) and upstream.protocol == 1
            assert (await read_all(stream))[-1]["reason"] == "length"
        assert sample(metrics, "dgw_worker_v1_fallbacks_total", worker_id, reason="not_spoken") == 2
        assert sample(metrics, "dgw_worker_v2_connections", worker_id) == 0
    finally:
        await http.close()
        await runner.cleanup()


@pytest.mark.parametrize("reply", [b"<html>not json</html>", b'[["r", {"no_event": 1}]]', b'{"r": 1}'])
async def test_a_malformed_worker_message_fails_the_streams_as_protocol_errors(reply: bytes) -> None:
    """A worker (here a raw WebSocket server) that answers with something else than `[[id, event], ...]`:
    every stream on the connection ends with a `protocol` error, and the connection is closed."""
    from aiohttp import web

    async def mux_handler(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        ops = orjson.loads((await ws.receive()).data)
        rid = ops[0]["request"]["request_id"]
        await ws.send_bytes(orjson.dumps([[rid, wp.ready_event(64, 0, 0)]]))
        await ws.send_bytes(reply)
        async for _ in ws:
            pass
        return ws

    app = web.Application()
    app.router.add_get(wp.MUX_PATH, mux_handler)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    http = await pool()
    try:
        upstream = DgwUpstream(DgwWorkerSpec(url=f"http://127.0.0.1:{runner.addresses[0][1]}"), http)
        stream = await upstream.generate(leg("r"))
        assert (await stream.next_event()) == wp.ready_event(64, 0, 0)
        with pytest.raises(UpstreamError) as broken:
            await stream.next_event()
        assert broken.value.kind is UpstreamKind.PROTOCOL and "malformed" in str(broken.value)
        assert upstream._mux is not None and upstream._mux.closed
    finally:
        await http.close()
        await runner.cleanup()


async def test_a_worker_that_never_answers_the_upgrade_times_out() -> None:
    """A listener that accepts and stays silent: the leg fails as a retryable timeout, not a hang."""
    held: list[asyncio.StreamWriter] = []

    async def silent(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    http = await pool(timeouts=Timeouts(first_event_s=0.5))
    try:
        upstream = DgwUpstream(DgwWorkerSpec(url=f"http://127.0.0.1:{port}"), http)
        started = time.perf_counter()
        with pytest.raises(UpstreamError) as timed_out:
            await upstream.generate(leg("nobody"))
        assert timed_out.value.kind is UpstreamKind.TIMEOUT and timed_out.value.retryable
        assert time.perf_counter() - started < 3.0
    finally:
        await http.close()
        for writer in held:
            writer.close()
        server.close()
        await server.wait_closed()


async def test_large_ops_pass_and_an_op_over_the_limit_goes_over_v1(worker: ServedApp,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    metrics = GatewayMetrics()
    http = await pool(metrics=metrics)
    try:
        upstream = DgwUpstream(DgwWorkerSpec(url=worker.url), http)
        worker_id = registered(metrics, upstream)
        # 17 MiB: above uvicorn's default WebSocket message limit (16 MiB), below v2's
        big = LegRequest("big", list(range(100, 164)), {"max_tokens": 3}, images=["A" * (17 << 20)],
                         image_token_adjustment=1)
        stream = await upstream.generate(big)
        assert isinstance(stream, MuxStream)
        assert (await read_all(stream))[-1]["event"] == "finish"  # answered (whatever the engine made of it)
        conn = upstream._mux
        assert conn is not None and not conn.closed
        monkeypatch.setattr(wp, "MAX_MUX_MESSAGE_BYTES", 1_000)  # a 64-token leg's op is ~350 bytes
        over = await upstream.generate(LegRequest("over", list(range(100, 350)), {"max_tokens": 5}))
        assert isinstance(over, WorkerStream)  # sent over v1
        assert (await read_all(over))[-1]["reason"] == "length"
        small = await upstream.generate(leg("small", max_tokens=5))
        assert isinstance(small, MuxStream) and upstream._mux is conn
        assert (await read_all(small))[-1]["reason"] == "length"
        assert sample(metrics, "dgw_worker_v1_fallbacks_total", worker_id, reason="too_large") == 1
        assert sample(metrics, "dgw_worker_v1_fallbacks_total", worker_id, reason="not_spoken") == 0
    finally:
        await http.close()
