"""WorkerStream's per-stream watchdog: each read has its own timeout; a stream slower than the
timeout in total but never between two events is not cut; a silent worker times out."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
from aiohttp import web

from deepinfer_gateway.core.errors import UpstreamError
from deepinfer_gateway.gateway.upstream.base import Timeouts
from deepinfer_gateway.gateway.upstream.dgw import WorkerStream

GAP_S, TIMEOUT_S = 0.1, 0.25


async def _server(lines: int, hang: bool) -> tuple[web.AppRunner, str]:
    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        for i in range(lines):
            await resp.write(b'{"event":"tokens","token_ids":[%d]}\n' % i)
            await asyncio.sleep(GAP_S)
        if hang:
            await asyncio.sleep(TIMEOUT_S + 1.5)
        return resp

    app = web.Application()
    app.router.add_get("/", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{port}/"


@pytest.mark.parametrize("hang", [False, True])
async def test_watchdog_times_out_only_a_silent_read(hang: bool) -> None:
    lines = 6  # 0.6 s in all: longer than the timeout, each gap well within it
    runner, url = await _server(lines, hang)
    try:
        async with aiohttp.ClientSession() as session:
            response = await session.get(url)
            stream = WorkerStream(response, Timeouts(first_event_s=TIMEOUT_S, between_events_s=TIMEOUT_S))
            got = []
            for _ in range(lines):
                event = await stream.next_event()
                assert event is not None
                got.append(event["token_ids"][0])
            assert got == list(range(lines))
            started = time.perf_counter()
            if hang:
                with pytest.raises(UpstreamError) as err:
                    await stream.next_event()
                assert err.value.kind == "timeout"
                assert TIMEOUT_S * 0.9 <= time.perf_counter() - started < TIMEOUT_S + 1.0
            else:
                assert await stream.next_event() is None
                assert stream._watchdog is None  # nothing left armed after the end
            stream.close()
            assert stream._watchdog is None
    finally:
        await runner.cleanup()
