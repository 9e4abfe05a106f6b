"""The embedded uvicorn server (asgi.py EmbeddedServer) on real loopback HTTP: no timer of its own
while no connection is open, a Date header that is fresh all the same, one tick a second while
connections are open, and a stop that takes effect at once."""

from __future__ import annotations

import asyncio
import time
from email.utils import parsedate_to_datetime
from typing import Any

import aiohttp
import pytest
from fastapi import FastAPI

from deepinfer_gateway.infra.asgi import EmbeddedServer, serve_app


def app() -> FastAPI:
    api = FastAPI()

    @api.get("/ping")
    async def ping() -> dict[str, str]:
        return {"ok": "yes"}

    return api


async def test_an_idle_server_does_not_tick_and_its_date_header_stays_fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    ticks: list[float] = []
    on_tick = EmbeddedServer.on_tick

    async def counted(self: EmbeddedServer, counter: int) -> Any:
        ticks.append(time.monotonic())
        return await on_tick(self, counter)

    monkeypatch.setattr(EmbeddedServer, "on_tick", counted)
    served = await serve_app(app())
    try:
        await asyncio.sleep(2.5)  # no connection: no tick after the first
        assert len(ticks) == 1
        async with aiohttp.ClientSession() as client:  # keeps its connection open between requests
            async with client.get(served.url + "/ping") as resp:
                assert resp.status == 200
                date = parsedate_to_datetime(resp.headers["Date"]).timestamp()
            assert abs(date - time.time()) < 2  # refreshed by the connection, not 2.5 s old
            await asyncio.sleep(2.2)  # a connection is open: ticks resume, one a second
            assert 2 <= len(ticks) - 1 <= 4
        started = time.monotonic()
        await served.stop()
        assert time.monotonic() - started < 1.0  # should_exit wakes the loop at once
    finally:
        if not served.task.done():
            await served.stop()
