"""In-flight reservations (bookings): what one replica reserves, the others see; leases expire."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import openai
import pytest
import redis.asyncio as aioredis

from deepinfer_gateway.infra.redis_conn import redis_client
from deepinfer_gateway.router.inflight import MemoryInflight, RedisInflight
from harness.launch import Gateway
from tests.conftest import redis_backend_url
from tests.fault_doubles import FaultyWorker


async def test_memory_reserve_release() -> None:
    inflight = MemoryInflight()
    inflight.reserve("w1", "r1", 100)
    inflight.reserve("w1", "r2", 50)
    assert await inflight.totals(["w1", "w2"]) == {"w1": 150, "w2": 0}
    inflight.release("w1", "r1")
    assert await inflight.totals(["w1"]) == {"w1": 50}
    inflight.reserve("w1", "r2", -20)  # a rebooking replaces the request's amount (router/booking.py)
    inflight.release("w1", "r1")  # released twice: nothing more comes off
    assert await inflight.totals(["w1"]) == {"w1": -20} and inflight.own("w1") == -20
    inflight.release("w1", "r2")
    assert await inflight.totals(["w1"]) == {"w1": 0} and inflight.own("w2") == 0


@pytest.mark.parametrize("backend", ["redis", "redis-cluster"])
async def test_replicas_share_reservations(backend: str, request: pytest.FixtureRequest) -> None:
    url = redis_backend_url(request, backend)
    clients = [redis_client(url, cluster=backend == "redis-cluster") for _ in range(2)]
    for worker in ("w1", "w2", "w3"):
        await clients[0].delete(f"{{dgw:inflight}}:{worker}:tok", f"{{dgw:inflight}}:{worker}:exp")
    a, b = (RedisInflight(c) for c in clients)
    a.reserve("w1", "ra", 1000)
    b.reserve("w2", "rb", 10)
    for replica in (a, b):  # writes land one round trip later
        await replica.flush()
    assert await b.totals(["w1", "w2", "w3"]) == {"w1": 1000, "w2": 10, "w3": 0}
    a.release("w1", "ra")
    await a.flush()
    assert (await b.totals(["w1"]))["w1"] == 0
    for c in clients:
        await c.aclose()


async def test_lease_of_a_dead_replica_expires(redis_url: str) -> None:
    client = aioredis.Redis.from_url(redis_url)
    dying = RedisInflight(client, lease_s=0.2)
    dying.reserve("w9", "lost", 500)  # this replica dies: no release ever comes
    await dying.flush()
    survivor = RedisInflight(client)
    assert (await survivor.totals(["w9"]))["w9"] == 500
    await asyncio.sleep(0.3)
    assert (await survivor.totals(["w9"]))["w9"] == 0
    await client.aclose()


async def test_redis_down_falls_back_to_local_view(redis_server) -> None:
    client = aioredis.Redis.from_url(redis_server.url, socket_timeout=0.3, socket_connect_timeout=0.3)
    errors: list[int] = []
    inflight = RedisInflight(client, on_error=lambda: errors.append(1), retry_interval_s=0.1)
    redis_server.stop()
    inflight.reserve("w1", "r1", 70)
    await inflight.flush()  # the write fails (counted); the reservation stays in the local view
    assert await inflight.totals(["w1"]) == {"w1": 70}
    assert errors
    redis_server.start()
    await asyncio.sleep(0.15)  # once the next probe is due
    assert await inflight.totals(["w1"]) == {"w1": 0}  # Redis is back (empty): its view again
    await client.aclose()


async def test_writes_are_batched_and_a_reservation_released_before_sending_is_never_sent(redis_server) -> None:
    client = aioredis.Redis.from_url(redis_server.url)
    inflight = RedisInflight(client)
    await inflight.totals(["w1"])  # loads the totals script
    await client.config_resetstat()

    async def scripts_run() -> int:
        return sum(stats["calls"] for name, stats in (await client.info("commandstats")).items()
                   if name in ("cmdstat_evalsha", "cmdstat_eval"))

    inflight.reserve("w1", "fast", 100)
    inflight.release("w1", "fast")  # its first token came before the writer ran
    await inflight.flush()
    assert await scripts_run() == 0
    for i in range(20):  # many requests in one event-loop turn: one call
        inflight.reserve("w1", f"r{i}", 10)
    await inflight.flush()
    assert await scripts_run() <= 2  # the write (and a script load if it was not cached)
    other = RedisInflight(client)
    assert await other.totals(["w1"]) == {"w1": 200}
    for i in range(20):
        inflight.release("w1", f"r{i}")
    await inflight.flush()
    assert await other.totals(["w1"]) == {"w1": 0}
    await client.aclose()


async def test_own_reservation_counts_once_before_and_after_it_lands(redis_url: str) -> None:
    client = aioredis.Redis.from_url(redis_url)
    await client.delete("{dgw:inflight}:w7:tok", "{dgw:inflight}:w7:exp")
    inflight = RedisInflight(client)
    inflight.reserve("w7", "r", 300)
    assert (await inflight.totals(["w7"]))["w7"] >= 300  # not in Redis yet: counted from the local view
    await inflight.flush()
    assert await inflight.totals(["w7"]) == {"w7": 300}
    inflight.release("w7", "r")
    await inflight.flush()
    assert await inflight.totals(["w7"]) == {"w7": 0}
    await client.aclose()


async def test_a_rebooking_replaces_the_landed_one_and_its_release_is_sent(redis_url: str) -> None:
    """A booking changes while its request waits (router/booking.py `Booking`): the new amount
    replaces the one Redis holds, and a release queued right after a re-booking still reaches
    Redis (the landed amount would otherwise stay until its lease expired)."""
    client = aioredis.Redis.from_url(redis_url)
    await client.delete("{dgw:inflight}:w8:tok", "{dgw:inflight}:w8:exp")
    inflight, other = RedisInflight(client), RedisInflight(client)
    inflight.reserve("w8", "r", 900)
    await inflight.flush()
    inflight.reserve("w8", "r", -600)  # now in a load report: minus its cached part
    assert await inflight.totals(["w8"]) == {"w8": -600}  # not landed yet: replaces 900, not added to it
    await inflight.flush()
    assert await other.totals(["w8"]) == {"w8": -600}
    inflight.reserve("w8", "r", -100)
    inflight.release("w8", "r")  # before the writer ran
    await inflight.flush()
    assert await other.totals(["w8"]) == {"w8": 0}
    await client.aclose()


async def test_a_gateway_stopping_mid_request_leaves_no_reservation_behind(redis_url: str, tmp_path: Path) -> None:
    """A request still waiting for its first token when the grace period ends is cancelled;
    its release is queued then, and must reach Redis before the gateway closes its client
    (else the other replicas count it until its lease expires). What the request books follows
    the worker's load reports (router/booking.py `Booking`; zero once a report shows it
    queued with nothing cached), so the test watches the booking's entry, not its amount."""
    client = aioredis.Redis.from_url(redis_url)
    worker = FaultyWorker("hang-before-ready")
    worker_id = worker.url.split("://", 1)[1]  # the gateway's id of a worker configured without one
    tok, exp = f"{{dgw:inflight}}:{worker_id}:tok", f"{{dgw:inflight}}:{worker_id}:exp"
    await client.delete(tok, exp)
    gateway = Gateway(tmp_path, [worker.spec()], extra_toml=f'redis.url = "{redis_url}"\n'
                      "shutdown_delay_s = 0.0\nshutdown_grace_s = 0.5\nfirst_event_timeout_s = 60.0")
    outcome: list[BaseException] = []
    try:
        gateway.wait_ready(1)
        sdk = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=30)

        def ask() -> None:
            try:
                sdk.chat.completions.create(model="DeepSeek-V4.1-Flash", max_tokens=4,
                                            messages=[{"role": "user", "content": "anyone there?"}])
            except openai.APIError as exc:
                outcome.append(exc)

        asker = threading.Thread(target=ask)
        asker.start()
        for _ in range(200):  # the booking lands in Redis and stays: the worker never sends `ready`
            if await client.hlen(tok) and await client.zcard(exp):
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("the request's booking never reached Redis")
        gateway.stop()
        assert gateway.proc.proc.returncode == 0  # drained and stopped by itself, not killed
        asker.join(10)
        assert outcome, "the stopped gateway's request must end with an error"
        left = await client.hgetall(tok), await client.zrange(exp, 0, -1)
        assert left == ({}, []), f"the release never reached Redis: {left}"
    finally:
        gateway.stop()
        worker.stop()
        await client.aclose()
