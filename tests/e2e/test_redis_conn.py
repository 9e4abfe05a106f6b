"""`redis_client` against a real Redis: a task cancelled in a Redis call stops, and a
restarted Redis is used again at once.

redis-py sends each command under `asyncio.wait_for`, which before Python 3.12 drops a
cancellation that lands as the send completes; `redis_client`'s connections send under
`asyncio.timeout` instead. The control (redis-py's own client) shows what is fixed."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator

import pytest
import redis.asyncio as aioredis

from deepinfer_gateway.infra.redis_conn import redis_client
from deepinfer_gateway.infra.redis_process import RedisProcess
from tests.conftest import RedisServer, _require_redis_server

CANCELS = 40


async def lost_cancels(client: aioredis.Redis, enough: int = CANCELS) -> int:
    """Cancel a task looping on GET at varied points; count the cancels it ignored (up to `enough`)."""
    await client.get("k")
    lost = 0
    for i in range(CANCELS):
        async def loop() -> None:
            while True:
                await client.get("k")

        task = asyncio.create_task(loop())
        await asyncio.sleep(0.0005 * (i % 7))
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=0.2)
        if not done:
            lost += 1
            while not task.done():  # end it for the next round
                task.cancel()
                await asyncio.wait({task}, timeout=0.1)
            if lost == enough:
                break
    return lost


@pytest.fixture(scope="module")
def unix_redis_url() -> Iterator[str]:
    _require_redis_server()
    with RedisProcess(unix_socket=True) as server:
        yield server.url


@pytest.mark.parametrize("transport", ["tcp", "unix"])
async def test_a_task_cancelled_in_a_redis_call_stops(transport: str, request: pytest.FixtureRequest) -> None:
    url = request.getfixturevalue("redis_url" if transport == "tcp" else "unix_redis_url")
    client = redis_client(url)
    try:
        assert await lost_cancels(client) == 0
    finally:
        await client.aclose()


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="asyncio.wait_for keeps cancellations from Python 3.12")
async def test_control_redis_py_alone_loses_cancels(redis_url: str) -> None:
    client = aioredis.Redis.from_url(redis_url, socket_timeout=0.5)
    try:
        assert await lost_cancels(client, enough=1) == 1
    finally:
        await client.aclose()


async def test_after_redis_restarts_pooled_connections_are_replaced_not_failed(redis_server: RedisServer) -> None:
    client = redis_client(redis_server.url)
    try:
        await asyncio.gather(*(client.get(f"k{i}") for i in range(8)))  # eight pooled connections
        redis_server.stop()
        redis_server.start()  # every pooled connection is now dead
        for i in range(8):  # each first use of a dead connection reconnects once, at once
            assert await client.set(f"k{i}", i)
    finally:
        await client.aclose()
