"""KV events long poll over real HTTP: sim workers served by uvicorn, the gateway's feeder."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from deepinfer_gateway.core.protocol import GENERATE_PATH, KV_EVENTS_PATH, MAX_KV_EVENTS_WAIT_MS
from deepinfer_gateway.kvcache.events import KvEventFeeder
from deepinfer_gateway.kvcache.memory import InMemoryPrefixIndex
from deepinfer_gateway.workers.sim.cluster import InProcessSimCluster, SimWorkerSpec, serve_sim_cluster
from tests.fault_doubles import until
from tests.kv_helpers import EventLog

FAST = 1000.0


@pytest.fixture(scope="module")
async def cluster() -> AsyncIterator[InProcessSimCluster]:
    c = await serve_sim_cluster([SimWorkerSpec("u0", time_scale=FAST)], compat=False)
    yield c
    await c.stop()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


def prompt(n: int, seed: int) -> list[int]:
    return [1000 + (i * 7 + seed) % 5000 for i in range(n)]


async def generate(http: aiohttp.ClientSession, url: str, rid: str, seed: int) -> None:
    body = {"request_id": rid, "token_ids": prompt(600, seed), "sampling": {"max_tokens": 1}}
    async with http.post(url + GENERATE_PATH, json=body) as resp:
        assert resp.status == 200
        await resp.read()


async def kv_events(http: aiohttp.ClientSession, url: str, **params: Any) -> tuple[int, Any, float]:
    loop = asyncio.get_running_loop()
    started = loop.time()
    async with http.get(url + KV_EVENTS_PATH, params={k: str(v) for k, v in params.items()}) as resp:
        return resp.status, await resp.json(), loop.time() - started


async def last_seq(http: aiohttp.ClientSession, url: str) -> int:
    _, batch, _ = await kv_events(http, url, after=0, limit=1)
    return int(batch["last_seq"])


def wait_tasks() -> list[asyncio.Task[Any]]:
    """The worker server's tasks of a held kv_events request (this test's loop serves it)."""
    names = ("wait_kv_events", "wait_past", "_disconnected")
    return [t for t in asyncio.all_tasks() if any(n in t.get_coro().__qualname__ for n in names)]


# --- worker server -------------------------------------------------------------------------

async def test_held_request_returns_when_events_arrive(cluster: InProcessSimCluster,
                                                       http: aiohttp.ClientSession) -> None:
    url = cluster.urls["u0"]
    cursor = await last_seq(http, url)
    held = asyncio.create_task(kv_events(http, url, after=cursor, wait_ms=20_000))
    await asyncio.sleep(0.3)
    assert not held.done()  # nothing past the cursor yet: the worker holds the reply
    await generate(http, url, "lp1", seed=1)
    status, batch, took = await asyncio.wait_for(held, 5)
    assert status == 200 and 0.3 <= took < 5
    assert batch["events"] and batch["events"][0]["seq"] == cursor + 1


async def test_held_request_returns_empty_at_the_wait(cluster: InProcessSimCluster,
                                                      http: aiohttp.ClientSession) -> None:
    url = cluster.urls["u0"]
    cursor = await last_seq(http, url)
    status, batch, took = await kv_events(http, url, after=cursor, wait_ms=300)
    assert status == 200 and batch["events"] == [] and batch["last_seq"] == cursor
    assert 0.3 <= took < 3
    assert wait_tasks() == []


async def test_no_wait_when_the_cursor_is_not_the_last_seq(cluster: InProcessSimCluster,
                                                           http: aiohttp.ClientSession) -> None:
    url = cluster.urls["u0"]
    cursor = await last_seq(http, url)
    status, batch, took = await kv_events(http, url, after=0, wait_ms=20_000)  # events pending
    assert status == 200 and len(batch["events"]) == cursor and took < 5
    status, batch, took = await kv_events(http, url, after=cursor + 50, wait_ms=20_000)  # another epoch's cursor
    assert status == 200 and batch["events"] == [] and batch["last_seq"] == cursor and took < 5


async def test_disconnect_mid_wait_ends_the_wait(cluster: InProcessSimCluster, http: aiohttp.ClientSession) -> None:
    url, port = cluster.urls["u0"], cluster.ports["u0"]
    cursor = await last_seq(http, url)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {KV_EVENTS_PATH}?after={cursor}&wait_ms=30000 HTTP/1.1\r\nhost: x\r\n\r\n".encode())
    await writer.drain()
    await until(lambda: len(wait_tasks()) == 2)  # the wait and the disconnect watch are running
    server_tasks = cluster.served["u0"].server.server_state.tasks
    assert len(server_tasks) == 1
    writer.close()
    await writer.wait_closed()
    await until(lambda: wait_tasks() == [] and not server_tasks, timeout=3)
    assert await reader.read() == b""  # no reply was written
    # the worker still serves long polls afterwards
    status, batch, _ = await kv_events(http, url, after=cursor, wait_ms=50)
    assert status == 200 and batch["events"] == []


@pytest.mark.parametrize("query, field", [
    ({"wait_ms": -1}, "wait_ms"),
    ({"wait_ms": MAX_KV_EVENTS_WAIT_MS + 1}, "wait_ms"),
    ({"wait_ms": "soon"}, "wait_ms"),
    ({"limit": 0}, "limit"),
    ({"after": -5}, "after"),
])
async def test_bad_query_is_a_400_error_json(cluster: InProcessSimCluster, http: aiohttp.ClientSession,
                                             query: dict[str, Any], field: str) -> None:
    status, body, took = await kv_events(http, cluster.urls["u0"], **query)
    assert status == 400 and took < 5
    assert body["error"]["kind"] == "invalid_request" and body["error"]["message"] == "invalid kv_events query"
    assert [d["loc"] for d in body["error"]["details"]] == [[field]]


# --- the gateway's feeder ----------------------------------------------------------------

def counting_session(counts: list[str]) -> aiohttp.ClientSession:
    trace = aiohttp.TraceConfig()

    async def on_start(_: Any, __: Any, params: aiohttp.TraceRequestStartParams) -> None:
        counts.append(str(params.url))

    trace.on_request_start.append(on_start)
    return aiohttp.ClientSession(trace_configs=[trace])


async def test_feeder_idle_costs_one_request_per_wait_and_wakes_on_events(
        cluster: InProcessSimCluster, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "deepinfer_gateway.kvcache.events")
    url = cluster.urls["u0"]
    polls: list[str] = []
    async with counting_session(polls) as session:
        index = InMemoryPrefixIndex()
        # timeout_s far below the wait: the request timeout must cover the wait on top
        feeder = KvEventFeeder(index, session, interval_s=0.01, wait_s=0.5, timeout_s=0.2)
        feeder.add_worker("u0", url)
        try:
            caught_up = await last_seq(http, url)
            await until(lambda: feeder.cursor("u0") == caught_up)
            polls.clear()
            await asyncio.sleep(1.6)
            assert 2 <= len(polls) <= 5  # ~1 per 0.5 s wait; without the long poll ~100 (every 10 ms)
            assert all("wait_ms=500" in p for p in polls)
            assert not [r for r in caplog.records if "failed" in r.getMessage()]
            before = feeder.cursor("u0")
            assert before is not None
            await generate(http, url, "lp-feed", seed=7)
            await until(lambda: (feeder.cursor("u0") or 0) > before, timeout=0.4)  # one round trip, not a wait
        finally:
            await asyncio.wait_for(feeder.aclose(), 1)  # cancels a held request at once
    await until(lambda: wait_tasks() == [], timeout=3)  # ...and the worker's wait ends with it


async def test_feeder_keeps_the_interval_with_a_worker_that_ignores_wait() -> None:
    """A worker without the long poll answers at once: polled every interval_s, not in a hot loop."""
    log = EventLog("old")
    seen: list[str] = []

    async def handle(request: web.Request) -> web.Response:
        seen.append(request.query.get("wait_ms", ""))
        body = log.batch(int(request.query["after"]), int(request.query["limit"])).model_dump_json()
        return web.Response(body=body, content_type="application/json")

    app = web.Application()
    app.router.add_get(KV_EVENTS_PATH, handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        async with aiohttp.ClientSession() as session:
            feeder = KvEventFeeder(InMemoryPrefixIndex(), session, interval_s=0.1, wait_s=1.0)
            feeder.add_worker("old", f"http://127.0.0.1:{port}")
            await asyncio.sleep(0.55)
            await feeder.aclose()
        assert 3 <= len(seen) <= 8 and set(seen) == {"1000"}
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("wait_s", [-0.1, MAX_KV_EVENTS_WAIT_MS / 1000 + 0.001])
async def test_feeder_refuses_a_wait_workers_would_reject(wait_s: float) -> None:
    async with aiohttp.ClientSession() as session:
        with pytest.raises(ValueError, match="wait_s"):
            KvEventFeeder(InMemoryPrefixIndex(), session, wait_s=wait_s)
