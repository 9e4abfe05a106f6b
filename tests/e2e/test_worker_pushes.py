"""Worker protocol v2 pushes over real loopback: sim workers served by uvicorn push their KV
events and load reports on the gateway's v2 connection, and the gateway's registry and KV
event feeder (the real ones, on one counting aiohttp session) poll and probe nothing over HTTP
while it is up; when it goes they poll and probe again from where they were, nothing lost; a
worker that does not push (an older one) is polled and probed as before."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from deepinfer_gateway.config import DgwWorkerSpec, HealthSettings
from deepinfer_gateway.core import protocol as wp
from deepinfer_gateway.gateway.fleet.registry import WorkerRegistry, WorkerState
from deepinfer_gateway.gateway.telemetry.metrics import GatewayMetrics
from deepinfer_gateway.gateway.upstream.base import LegRequest
from deepinfer_gateway.gateway.upstream.dgw import DgwUpstream
from deepinfer_gateway.gateway.upstream.http import HttpPool
from deepinfer_gateway.infra.asgi import serve_app
from deepinfer_gateway.kvcache.events import KvEventFeeder
from deepinfer_gateway.kvcache.memory import InMemoryPrefixIndex
from deepinfer_gateway.workers import mux as worker_mux
from deepinfer_gateway.workers.deepinfer import DeepInferConfig, DeepInferEngine, MemoryKvStore
from deepinfer_gateway.workers.server import create_worker_app
from deepinfer_gateway.workers.sim.cluster import InProcessSimCluster, SimWorkerSpec, serve_sim_cluster
from harness.launch import Gateway as GatewayProcess
from tests.deepinfer_double import DoubleKvTransfer, core
from tests.fault_doubles import until

FAST = 1000.0
POLLED = (wp.KV_EVENTS_PATH, wp.LOAD_PATH, wp.INFO_PATH)


def prompt(n: int, seed: int) -> list[int]:
    return [1000 + (i * 7 + seed) % 5000 for i in range(n)]


@dataclass
class Gateway:
    """The gateway's worker-facing parts, as serve composes them, on one counting session."""

    http: HttpPool
    registry: WorkerRegistry
    feeder: KvEventFeeder
    requests: list[str]  # path of every HTTP request sent to a worker

    def worker(self, worker_id: str) -> WorkerState:
        return self.registry.workers[worker_id]

    def upstream(self, worker_id: str) -> DgwUpstream:
        upstream = self.worker(worker_id).upstream
        assert isinstance(upstream, DgwUpstream)
        return upstream

    def polls(self) -> list[str]:
        return [path for path in self.requests if path in POLLED]

    async def quiet(self) -> None:
        """Once the polls and probes under way when the pushes came up are over: a 0.3 s window
        without any (a loaded machine can stretch the first)."""
        for _ in range(10):
            self.requests.clear()
            await asyncio.sleep(0.3)
            if not self.polls():
                return
        raise AssertionError(f"still polled: {self.polls()}")


@asynccontextmanager
async def gateway(cluster: InProcessSimCluster | dict[str, str]) -> AsyncIterator[Gateway]:
    """In front of `cluster`'s workers (or of {worker id: url})."""
    urls = cluster if isinstance(cluster, dict) else cluster.urls
    requests: list[str] = []
    trace = aiohttp.TraceConfig()

    async def on_start(_: Any, __: Any, params: aiohttp.TraceRequestStartParams) -> None:
        requests.append(params.url.path)

    trace.on_request_start.append(on_start)
    async with aiohttp.ClientSession(trace_configs=[trace]) as session:
        http = HttpPool(session=session)
        await http.start()
        metrics = GatewayMetrics()
        specs = tuple(DgwWorkerSpec(url=url, id=wid) for wid, url in urls.items())
        registry = WorkerRegistry(specs, http_factory(http), HealthSettings(interval_s=0.1), metrics)
        feeder = KvEventFeeder(InMemoryPrefixIndex(), session, interval_s=0.01, wait_s=0.2)
        for wid, state in registry.workers.items():
            feeder.add(wid, state.upstream.kv_source())
        await registry.start()
        try:
            yield Gateway(http, registry, feeder, requests)
        finally:
            await feeder.aclose()
            await registry.stop()
            for state in registry.workers.values():
                state.upstream.retire()
            await http.close()


def http_factory(http: HttpPool) -> Any:
    class Factory:
        @staticmethod
        def upstream(spec: DgwWorkerSpec) -> DgwUpstream:
            return DgwUpstream(spec, http)

    return Factory()


async def generate_over_v2(gw: Gateway, worker_id: str, rid: str, seed: int) -> None:
    stream = await gw.upstream(worker_id).generate(
        LegRequest(rid, prompt(600, seed), {"max_tokens": 4}))
    try:
        while await stream.next_event() is not None:
            pass
    finally:
        stream.close()


@pytest.fixture
async def cluster() -> AsyncIterator[InProcessSimCluster]:
    c = await serve_sim_cluster([SimWorkerSpec("w0", time_scale=FAST), SimWorkerSpec("w1", time_scale=FAST)],
                                compat=False)
    yield c
    await c.stop()


async def test_a_pushing_worker_is_neither_polled_nor_probed(cluster: InProcessSimCluster) -> None:
    async with gateway(cluster) as gw:
        await until(lambda: all(w.healthy and w.pushes_live for w in gw.registry.workers.values()))
        engine = cluster.engines["w0"]
        await until(lambda: gw.feeder.cursor("w0") == engine.kv_events(10**12, 1).last_seq)
        await gw.quiet()
        state = gw.worker("w0")
        before = state.load.prompt_tokens_total if state.load else 0
        counted: list[bool] = []
        for i in range(5):
            await generate_over_v2(gw, "w0", f"push-{i}", seed=i)
            gw.registry.after_report(state, gw.registry.loop_lag.now(), lambda: counted.append(True))
        # The KV events reach the index, the load view and the bookings' hooks follow the reports.
        await until(lambda: gw.feeder.cursor("w0") == engine.kv_events(10**12, 1).last_seq)
        await until(lambda: state.load is not None and state.load.prompt_tokens_total >= before + 5 * 600)
        await until(lambda: len(counted) == 5)
        await asyncio.sleep(0.5)  # five check intervals of the registry, 50 poll intervals of the feeder
        assert gw.polls() == []
        assert gw.worker("w1").healthy and gw.worker("w1").pushes_live


async def test_a_deepinfer_worker_pushes_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(core, "STEP_DELAY_S", 0.005)
    config = DeepInferConfig(model="/m", role=wp.Role.UNIFIED, worker_id="di-0", drain_timeout_s=0)
    engine = DeepInferEngine(config, api_root="tests.deepinfer_double", kv_store=MemoryKvStore(),
                             kv_transfer=DoubleKvTransfer())
    served = await serve_app(create_worker_app(engine))
    try:
        async with gateway({"di-0": served.url}) as gw:
            await until(lambda: gw.worker("di-0").healthy and gw.worker("di-0").pushes_live)
            await gw.quiet()
            state = gw.worker("di-0")
            counted: list[bool] = []
            for i in range(3):
                await generate_over_v2(gw, "di-0", f"di-push-{i}", seed=20 + i)
                gw.registry.after_report(state, gw.registry.loop_lag.now(), lambda: counted.append(True))
            await until(lambda: gw.feeder.cursor("di-0") == engine.kv_events(10**12, 1).last_seq)
            await until(lambda: len(counted) == 3)  # pushed reports that count each request
            assert state.load == engine.load()
            assert gw.polls() == []
    finally:
        await served.stop()


async def test_a_dropped_connection_falls_back_to_polling_then_pushes_again(cluster: InProcessSimCluster) -> None:
    async with gateway(cluster) as gw, aiohttp.ClientSession() as client:
        await until(lambda: gw.worker("w0").pushes_live)
        engine = cluster.engines["w0"]
        conn = gw.upstream("w0")._mux
        assert conn is not None
        gw.requests.clear()
        conn.close()
        await until(lambda: conn.closed)
        # Events logged while no connection pushes (a v1 request from elsewhere) are polled.
        body = {"request_id": "v1-while-down", "token_ids": prompt(700, 9), "sampling": {"max_tokens": 2}}
        async with client.post(cluster.urls["w0"] + wp.GENERATE_PATH, data=orjson.dumps(body)) as resp:
            assert resp.status == 200
            await resp.read()
        await until(lambda: gw.feeder.cursor("w0") == engine.kv_events(10**12, 1).last_seq, timeout=2)
        assert wp.KV_EVENTS_PATH in gw.polls()
        await until(lambda: wp.LOAD_PATH in gw.polls(), timeout=1)  # the registry's next check probes it
        # The next check asks it to push again; then the polls stop.
        await until(lambda: gw.worker("w0").pushes_live and gw.upstream("w0")._mux is not conn)
        await gw.quiet()
        await generate_over_v2(gw, "w0", "after-reconnect", seed=11)
        await until(lambda: gw.feeder.cursor("w0") == engine.kv_events(10**12, 1).last_seq)
        await asyncio.sleep(0.3)
        assert gw.polls() == []


async def test_a_killed_worker_is_probed_again_and_ejected(cluster: InProcessSimCluster) -> None:
    async with gateway(cluster) as gw:
        await until(lambda: all(w.healthy and w.pushes_live for w in gw.registry.workers.values()))
        await cluster.served["w0"].stop()
        await until(lambda: not gw.worker("w0").healthy, timeout=3)
        assert gw.worker("w1").healthy and gw.worker("w1").pushes_live
        assert wp.LOAD_PATH in gw.polls()  # the checks resumed
        assert wp.KV_EVENTS_PATH in gw.polls()  # so did the feeder's polls


async def test_a_worker_that_does_not_push_is_polled_and_probed(cluster: InProcessSimCluster,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # An older worker: it accepts the v2 upgrade without selecting the push subprotocol.
    monkeypatch.setattr(worker_mux, "MUX_PUSH_SUBPROTOCOL", "dgw.worker.v2.some-other-extension")
    async with gateway(cluster) as gw:
        await until(lambda: all(w.healthy for w in gw.registry.workers.values()))
        await generate_over_v2(gw, "w0", "old-worker", seed=3)  # legs still go over v2
        conn = gw.upstream("w0")._mux
        assert conn is not None and not conn.closed and not conn.pushes
        engine = cluster.engines["w0"]
        await until(lambda: gw.feeder.cursor("w0") == engine.kv_events(10**12, 1).last_seq)
        gw.requests.clear()
        await asyncio.sleep(0.5)
        assert not gw.worker("w0").pushes_live
        assert gw.polls().count(wp.LOAD_PATH) >= 4  # every 0.1 s, both workers
        assert wp.KV_EVENTS_PATH in gw.polls()


async def test_a_gateway_that_does_not_ask_gets_no_pushes(cluster: InProcessSimCluster) -> None:
    """An older gateway: no subprotocol offered, so the worker selects none and sends only events."""
    async with aiohttp.ClientSession() as client, client.ws_connect(cluster.urls["w0"] + wp.MUX_PATH) as ws:
        assert ws.protocol is None
        request = {"request_id": "old-gw", "token_ids": prompt(300, 1), "sampling": {"max_tokens": 2}}
        await ws.send_bytes(orjson.dumps([wp.generate_op(request)]))
        events: list[dict[str, Any]] = []
        while not events or events[-1]["event"] != "finish":
            message = orjson.loads((await ws.receive()).data)
            assert isinstance(message, list)  # never a push object
            events += [event for _, event in message]
        assert events[-1]["reason"] == "length"


class CountRequests:
    """ASGI middleware on a worker: the path of every HTTP request it serves."""

    def __init__(self, app: Any, seen: list[str]) -> None:
        self.app, self.seen = app, seen

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            self.seen.append(scope["path"])
        await self.app(scope, receive, send)


async def test_a_gateway_process_indexes_the_kv_events_of_its_traffic_without_polling(tmp_path: Path) -> None:
    seen: list[str] = []
    cluster = await serve_sim_cluster([SimWorkerSpec("p0", time_scale=FAST)], compat=False,
                                      wrap=lambda app: CountRequests(app, seen))
    url = cluster.urls["p0"]
    gw = await asyncio.to_thread(GatewayProcess, tmp_path, [(url, "unified", "sm100")], "admin_keys_required = false",
                                 health_interval_s=0.2)
    try:
        await asyncio.to_thread(gw.wait_ready, 1)
        async with aiohttp.ClientSession() as client:
            for _ in range(20):  # the gateway's checks and polls stop once the worker pushes
                seen.clear()
                await asyncio.sleep(0.5)
                if not [p for p in seen if p in POLLED]:
                    break
            else:
                raise AssertionError(f"still polled: {seen}")
            for i in range(3):
                body = {"model": "DeepSeek-V4.1-Flash", "max_tokens": 4,
                        "messages": [{"role": "user", "content": f"pushed kv events {i} " * 200}]}
                async with client.post(gw.url + "/v1/chat/completions", json=body) as resp:
                    assert resp.status == 200, await resp.text()
            engine = cluster.engines["p0"]
            assert engine.kv_events(10**12, 1).last_seq > 1  # the traffic stored blocks

            async def indexed() -> int:
                async with client.get(gw.url + "/admin/index") as resp:
                    return int((await resp.json())["workers"][url.split("://", 1)[1]]["last_seq"])

            deadline = time.monotonic() + 5
            while await indexed() != engine.kv_events(10**12, 1).last_seq:
                assert time.monotonic() < deadline, "the index never caught up"
                await asyncio.sleep(0.02)
        assert [p for p in seen if p in POLLED] == []
    finally:
        await asyncio.to_thread(gw.stop)
        await cluster.stop()
