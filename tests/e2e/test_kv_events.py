"""The event feeder over real HTTP: a tiny aiohttp worker serving KvEventBatch JSON."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import pytest
from aiohttp import web

from deepinfer_gateway.core.protocol import KV_EVENTS_PATH
from deepinfer_gateway.kvcache.events import KvEventFeeder
from deepinfer_gateway.kvcache.memory import InMemoryPrefixIndex
from tests.fault_doubles import until
from tests.kv_helpers import EventLog

H = list(range(1000, 1256))


class FakeWorker:
    """Serves one EventLog at KV_EVENTS_PATH; `down` answers 503."""

    def __init__(self, log: EventLog) -> None:
        self.log = log
        self.down = False
        self.refused = 0  # polls answered 503 while down
        self.requests: list[tuple[int, int]] = []
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def handle(self, request: web.Request) -> web.Response:
        if self.down:
            self.refused += 1
            return web.Response(status=503)
        after, limit = int(request.query["after"]), int(request.query["limit"])
        self.requests.append((after, limit))
        body = self.log.batch(after=after, limit=limit).model_dump_json()
        return web.Response(body=body, content_type="application/json")

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get(KV_EVENTS_PATH, self.handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


@pytest.fixture
async def worker_factory() -> AsyncIterator[Callable[[EventLog], Awaitable[FakeWorker]]]:
    started: list[FakeWorker] = []

    async def make(log: EventLog) -> FakeWorker:
        worker = FakeWorker(log)
        await worker.start()
        started.append(worker)
        return worker

    yield make
    for worker in started:
        await worker.stop()


async def memory_blocks(index: InMemoryPrefixIndex, worker_id: str, hashes: list[int] = H) -> int:
    return (await index.lookup({"f": hashes}, {worker_id: "f"})).memory[worker_id]


async def test_feeds_events_and_pages_through_a_backlog(
    session: aiohttp.ClientSession, worker_factory: Callable[[EventLog], Awaitable[FakeWorker]]
) -> None:
    log = EventLog("w1")
    for h in H:
        log.store_mem([h])
    worker = await worker_factory(log)
    index = InMemoryPrefixIndex()
    feeder = KvEventFeeder(index, session, interval_s=0.01, limit=50)
    feeder.add_worker("w1", worker.url)
    try:
        await until(lambda: feeder.cursor("w1") == len(H))
        assert await memory_blocks(index, "w1") == len(H)
        assert [a for a, _ in worker.requests[:6]] == [0, 50, 100, 150, 200, 250]
        log.evict_mem([H[100]])
        await until(lambda: feeder.cursor("w1") == len(H) + 1)
        assert await memory_blocks(index, "w1") == 100
    finally:
        await feeder.aclose()


async def test_worker_restart_drops_its_memory_tier(
    session: aiohttp.ClientSession, worker_factory: Callable[[EventLog], Awaitable[FakeWorker]]
) -> None:
    log = EventLog("w1")
    log.store_mem(H[:100])
    worker = await worker_factory(log)
    index = InMemoryPrefixIndex()
    feeder = KvEventFeeder(index, session, interval_s=0.01)
    feeder.add_worker("w1", worker.url)
    try:
        await until(lambda: feeder.cursor("w1") == 1)
        log.restart("e2")
        log.store_mem(H[:7])
        await until(lambda: feeder.cursor("w1") == 2 and index.cursor("w1").epoch == "e2")
        assert await memory_blocks(index, "w1") == 7
    finally:
        await feeder.aclose()


async def test_falling_behind_retention_resyncs(
    session: aiohttp.ClientSession, worker_factory: Callable[[EventLog], Awaitable[FakeWorker]]
) -> None:
    log = EventLog("w1", retention=10)
    log.store_mem([1])
    worker = await worker_factory(log)
    index = InMemoryPrefixIndex()
    feeder = KvEventFeeder(index, session, interval_s=0.01)
    feeder.add_worker("w1", worker.url)
    try:
        await until(lambda: feeder.cursor("w1") == 1)
        worker.down = True
        await asyncio.sleep(0.05)
        for h in H[:30]:  # 30 events while unreachable; only the last 10 are retained
            log.store_mem([h])
        worker.down = False
        await until(lambda: feeder.cursor("w1") == 31)
        assert await memory_blocks(index, "w1", [1]) == 0  # dropped with the lost history
        assert await memory_blocks(index, "w1", H[20:30]) == 10
    finally:
        await feeder.aclose()


async def test_unreachable_worker_is_retried_and_logged_once(
    session: aiohttp.ClientSession,
    worker_factory: Callable[[EventLog], Awaitable[FakeWorker]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    log = EventLog("w1")
    log.store_mem(H[:3])
    worker = await worker_factory(log)
    worker.down = True
    index = InMemoryPrefixIndex()
    feeder = KvEventFeeder(index, session, interval_s=0.005, max_backoff_s=0.02)
    feeder.add_worker("w1", worker.url)
    feeder.add_worker("gone", "http://127.0.0.1:1")
    try:
        await until(lambda: worker.refused >= 3)  # several failed polls (not a wall-clock guess)
        worker.down = False
        await until(lambda: feeder.cursor("w1") == 1)
        assert await memory_blocks(index, "w1") == 3
        failures = [r for r in caplog.records if "polling w1 failed" in r.getMessage()]
        assert len(failures) == 1
    finally:
        await feeder.aclose()


async def test_remove_worker_stops_polling_and_forgets(
    session: aiohttp.ClientSession, worker_factory: Callable[[EventLog], Awaitable[FakeWorker]]
) -> None:
    log = EventLog("w1")
    log.store_mem(H[:3])
    worker = await worker_factory(log)
    index = InMemoryPrefixIndex()
    feeder = KvEventFeeder(index, session, interval_s=0.01)
    feeder.add_worker("w1", worker.url)
    await until(lambda: feeder.cursor("w1") == 1)
    await feeder.remove_worker("w1")
    seen = len(worker.requests)
    await asyncio.sleep(0.05)
    assert len(worker.requests) == seen
    assert await memory_blocks(index, "w1") == 0
    await feeder.aclose()


async def test_backlog_is_drained_without_waiting_for_the_interval(
    session: aiohttp.ClientSession, worker_factory: Callable[[EventLog], Awaitable[FakeWorker]]
) -> None:
    log = EventLog("w1")
    for h in H[:5]:
        log.store_mem([h])
    worker = await worker_factory(log)
    index = InMemoryPrefixIndex()
    feeder = KvEventFeeder(index, session, interval_s=3600, limit=2)
    feeder.add_worker("w1", worker.url)  # 5 events, 2 per poll, hour-long interval
    await until(lambda: feeder.cursor("w1") == 5)
    assert await memory_blocks(index, "w1") == 5
    await feeder.aclose()
