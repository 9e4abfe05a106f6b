"""Two gateway replicas on one real Redis keep one fair share (flow_control.shared_share): tenant A
floods both replicas, tenant B only the first; both saturate one small sim worker (4 sequences).
Shared, B gets about half the pool's starts; each replica alone shares only what it starts, so B
gets about a quarter. Real HTTP, the openai SDK, real Redis."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from redis import asyncio as aioredis

from deepinfer_gateway.gateway.serving.flow_share_sync import FlowShareSync
from deepinfer_gateway.infra.redis_process import RedisProcess as RedisServer
from deepinfer_gateway.router.flow import FlowLimits, FlowPolicy, FlowRequest, PoolLoad, Tier, WorkerLoad
from harness.launch import Gateway, SimCluster
from tests.fault_doubles import scrape, total
from tests.gateways import api_key
from tests.sim_profiles import small_sm100

MODEL = "DeepSeek-V4.1-Flash"
BUSY = PoolLoad((WorkerLoad(0.5, 10_000.0, 0, 1, 0.1),))
PROMPT = [{"role": "user", "content": "share the pool fairly " * 20}]
FLOW = """[flow_control]
enabled = true
max_engine_wait_ms = 100
max_engine_waiting = 2
default_ttft_ms = 120000
shared_share = {shared}
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimCluster]:
    profile = tmp_path_factory.mktemp("share-profile") / "profiles.toml"
    profile.write_text(small_sm100())
    cluster = SimCluster("unified:sm100", time_scale=1.0, extra=["--profiles", str(profile)])
    yield cluster
    cluster.stop()


def _replicas(tmp: Path, cluster: SimCluster, redis_url: str, shared: bool) -> list[Gateway]:
    toml = (f'redis.url = "{redis_url}"\nredis.timeout_s = 10\n'
            "[router.hardware.sm100]\nprefill_tokens_per_s = 20000.0\nkv_load_bytes_per_s = 25e9\n"
            + FLOW.format(shared=str(shared).lower()) + api_key("a", "sk-a") + api_key("b", "sk-b"))
    gateways = [Gateway(tmp, [(cluster.urls[0], "unified", "sm100")], extra_toml=toml) for _ in range(2)]
    for gw in gateways:
        gw.wait_ready(1)
    return gateways


async def _client_loop(gw: Gateway, key: str, tenant: str, stop: asyncio.Event, done: list[tuple[float, str]]
                       ) -> None:
    client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0, timeout=120)
    while not stop.is_set():
        await client.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=30)
        done.append((time.monotonic(), tenant))


async def _b_share(first: Gateway, second: Gateway, warmup_s: float = 4.0, window_s: float = 12.0
                   ) -> tuple[float, float]:
    """B's share of the requests completed over `window_s`, once every client's queue has formed, and
    how many other routers the first replica's exchange heard then."""
    stop, done = asyncio.Event(), list[tuple[float, str]]()
    clients = ([_client_loop(gw, "sk-a", "a", stop, done) for gw in (first, second) for _ in range(8)]
               + [_client_loop(first, "sk-b", "b", stop, done) for _ in range(8)])
    tasks = [asyncio.create_task(c) for c in clients]
    await asyncio.sleep(warmup_s)
    start = time.monotonic()
    await asyncio.sleep(window_s)
    heard = total(await asyncio.to_thread(scrape, first.url), "dgw_flow_share_routers")
    stop.set()
    await asyncio.gather(*tasks)
    window = [tenant for at, tenant in done if start <= at < start + window_s]
    assert len(window) >= 40, window  # the pool runs about 8 requests a second
    return window.count("b") / len(window), heard


@pytest.mark.parametrize("shared", [True, False])
def test_replicas_keep_one_fair_share(cluster: SimCluster, redis_url: str, tmp_path: Path, shared: bool) -> None:
    first, second = _replicas(tmp_path, cluster, redis_url, shared)
    try:
        share, heard = asyncio.run(_b_share(first, second))
        errors = total(scrape(first.url), "dgw_redis_errors_total", component="flow")
    finally:
        first.stop()
        second.stop()
    if shared:
        assert 0.4 <= share <= 0.6, share
        assert heard == 1 and errors == 0
    else:  # each replica alone: B competes for the first replica's half of the pool only
        assert share < 0.36, share
        assert heard == 0


async def test_the_exchange_through_redis_survives_an_outage(redis_server: RedisServer) -> None:
    """Two routers' exchanges on a real Redis: each hears the other's queued tenant; with Redis down
    each keeps its own share (errors counted, nothing held back); back up, they hear each other again."""
    errors: list[int] = []
    routers = []
    for tenant in ("a", "b"):
        client = aioredis.Redis.from_url(redis_server.url, socket_timeout=1.0)
        sync = FlowShareSync(client, half_life_s=10.0, interval_s=0.1, on_error=lambda: errors.append(1))
        sync.policy = policy = FlowPolicy(FlowLimits(), sync.share_of)
        policy.pool("p").arrive(FlowRequest(tenant, Tier.DEFAULT, 100, 100, 0.0, 1e9), BUSY, 0.0)
        routers.append((sync, client))
    try:
        for sync, _ in routers * 2:
            await sync.sync()
        now = asyncio.get_running_loop().time()
        for (sync, _), other in zip(routers, ("b", "a"), strict=True):
            assert [r.queued for r in sync.shares["p"].others] == [{(Tier.DEFAULT, other): 1}]
            assert sync.shares["p"].waits_elsewhere(Tier.DEFAULT, now)
        redis_server.stop()
        await routers[0][0].sync()
        assert errors and routers[0][0].shares["p"].others == []
        redis_server.start()  # empty, same port; each client's first call fails on its old connection
        deadline = asyncio.get_running_loop().time() + 5.0
        while not all(len(sync.shares["p"].others) == 1 for sync, _ in routers):
            assert asyncio.get_running_loop().time() < deadline, "the routers never heard each other again"
            for sync, _ in routers:
                await sync.sync()
            await asyncio.sleep(0.1)
    finally:
        for _, client in routers:
            await client.aclose()
