"""Rate-limit buckets: the pure arithmetic, and one contract suite over memory and Redis."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from deepinfer_gateway.gateway.serving import ratelimit
from deepinfer_gateway.gateway.serving.ratelimit import MemoryRateLimiter, RedisRateLimiter, take
from deepinfer_gateway.infra.redis_conn import redis_client
from tests.conftest import redis_backend_url


def test_take_admits_until_the_request_bucket_is_empty() -> None:
    levels: tuple = (None, None)
    last = None
    for _ in range(3):
        verdict, levels = take(levels, last, 100.0, (3, None), 10)
        last = 100.0
        assert verdict.allowed
    verdict, _ = take(levels, last, 100.0, (3, None), 10)
    assert not verdict.allowed
    assert verdict.retry_after_s == pytest.approx(20.0)  # one request refills in 60/3 s


def test_take_refills_with_time_and_caps_at_the_limit() -> None:
    verdict, levels = take((0.0, None), 0.0, 30.0, (4, None), 0)
    assert verdict.allowed and levels[0] == pytest.approx(1.0)  # 2 refilled, 1 taken
    verdict, levels = take((0.0, None), 0.0, 6000.0, (4, None), 0)
    assert levels[0] == pytest.approx(3.0)  # capped at 4 before taking one


def test_take_never_blocks_a_prompt_larger_than_the_whole_token_limit() -> None:
    verdict, levels = take((None, None), None, 0.0, (None, 1000), 5000)
    assert verdict.allowed and levels[1] == pytest.approx(-4000)
    verdict, _ = take(levels, 0.0, 1.0, (None, 1000), 10)
    assert not verdict.allowed and verdict.retry_after_s > 0


def test_verdict_headers() -> None:
    verdict, _ = take((0.0, None), 0.0, 0.0, (2, None), 0)
    headers = verdict.headers()
    assert headers["x-ratelimit-limit-requests"] == "2"
    assert headers["x-ratelimit-remaining-requests"] == "0"
    assert int(headers["retry-after"]) >= 1


@pytest.fixture(params=["memory", "redis", "redis-cluster"])
async def limiter(request: pytest.FixtureRequest) -> AsyncIterator[object]:
    if request.param == "memory":
        yield MemoryRateLimiter()
        return
    url = redis_backend_url(request, request.param)
    client = redis_client(url, cluster=request.param == "redis-cluster")
    for key in ("k1", "k2", "other"):  # one slot each on a cluster
        await client.delete(ratelimit.bucket_key(key))
    yield RedisRateLimiter(client)
    await client.aclose()


async def test_contract_request_limit(limiter) -> None:
    verdicts = [await limiter.admit("k1", (5, None), 1) for _ in range(7)]
    assert [v.allowed for v in verdicts] == [True] * 5 + [False] * 2
    assert (await limiter.admit("other", (5, None), 1)).allowed  # keys are independent


async def test_contract_tokens_are_reserved_and_the_unused_refunded(limiter) -> None:
    limits = (10, 1000)
    assert (await limiter.admit("k2", limits, 0)).allowed  # admitted before its tokens are known
    # Prepared: its prompt (100) and its whole max_tokens (500) are taken before it runs, so a
    # second one running beside it cannot overrun the limit.
    first = await limiter.admit("k2", limits, 600, requests=0)
    assert first.allowed and first.remaining_requests == pytest.approx(9, abs=0.1)  # no request taken
    second = await limiter.admit("k2", limits, 600, requests=0)
    assert not second.allowed and second.retry_after_s > 0
    await limiter.refund("k2", 1000, 500)  # the first ended using none of its output
    third = await limiter.admit("k2", limits, 600, requests=0)
    assert third.allowed and third.remaining_tokens == pytest.approx(300, abs=5)
    await limiter.refund("k2", 1000, 100_000)  # never above the limit
    assert (await limiter.admit("k2", limits, 1000, requests=0)).remaining_tokens == pytest.approx(0, abs=5)


@pytest.mark.parametrize("backend", ["redis", "redis-cluster"])
async def test_redis_limit_is_atomic_across_concurrent_callers(backend: str, request: pytest.FixtureRequest) -> None:
    url = redis_backend_url(request, backend)
    # The limiter fails open on a Redis error, and the gateway's 0.5 s timeout is one a busy machine
    # can pass with 40 calls opening connections at once: each fail-open would be one admit too
    # many. Atomicity is the point here, so the clients wait longer and any fail-open is reported.
    clients = [redis_client(url, cluster=backend == "redis-cluster", timeout_s=10) for _ in range(2)]
    await clients[0].delete("dgw:rl:{burst}")
    errors: list[int] = []
    limiters = [RedisRateLimiter(c, on_error=lambda: errors.append(1)) for c in clients]  # two "replicas"
    verdicts = await asyncio.gather(*(limiters[i % 2].admit("burst", (10, None), 1) for i in range(40)))
    assert not errors, "Redis failed during the burst: the limiter failed open"
    assert sum(v.allowed for v in verdicts) == 10
    for c in clients:
        await c.aclose()


@pytest.mark.parametrize("backend", ["redis", "redis-cluster"])
async def test_redis_limit_holds_across_replicas_with_skewed_clocks(
    backend: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Replicas whose clocks are 30 s apart take turns: the bucket refills by one clock (Redis's),
    so none of them refills the same interval again (at 10/min, 30 s would be 5 more admits)."""
    url = redis_backend_url(request, backend)
    client = redis_client(url, cluster=backend == "redis-cluster", timeout_s=10)
    await client.delete("dgw:rl:{skew}")
    turns = itertools.cycle([0.0, -30.0])

    class SkewedClock:  # each caller's wall clock, alternately on time and 30 s behind
        monotonic = staticmethod(time.monotonic)

        @staticmethod
        def time() -> float:
            return time.time() + next(turns)

    monkeypatch.setattr(ratelimit, "time", SkewedClock)
    limiter = RedisRateLimiter(client)
    verdicts = [await limiter.admit("skew", (10, None), 1) for _ in range(40)]
    assert sum(v.allowed for v in verdicts) == 10
    await client.aclose()


async def test_redis_down_fails_open(redis_server) -> None:
    client = aioredis.Redis.from_url(redis_server.url, socket_timeout=0.3, socket_connect_timeout=0.3)
    errors = []
    limiter = RedisRateLimiter(client, on_error=lambda: errors.append(1), retry_interval_s=0.1)
    assert (await limiter.admit("k", (1, None), 1)).allowed
    redis_server.stop()
    assert (await limiter.admit("k", (1, None), 1)).allowed  # would be refused if Redis answered
    assert errors
    redis_server.start()  # a fresh, empty server on the same port: limits apply again
    await asyncio.sleep(0.15)  # once the next probe is due
    assert (await limiter.admit("k", (1, None), 1)).allowed
    assert not (await limiter.admit("k", (1, None), 1)).allowed
    await client.aclose()


def test_concurrent_requests_cannot_overrun_the_token_limit(tmp_path) -> None:
    """Through the gateway with the openai SDK: each request reserves its prompt and its whole
    max_tokens before it runs. Counting output only once it ended, all six would pass."""
    import hashlib
    import threading

    import openai

    from harness.launch import Gateway, SimCluster

    cluster = SimCluster("unified:sm100")
    key = "sk-tokens"
    toml = (f'[[api_keys]]\nname = "tokens"\nkey_sha256 = "{hashlib.sha256(key.encode()).hexdigest()}"\n'
            "tokens_per_minute = 300\n")
    gateway = Gateway(tmp_path, [(url, "unified", "sm100") for url in cluster.urls], extra_toml=toml)
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0, timeout=30)
    start = threading.Barrier(6)
    outcomes: list[str] = []

    def ask() -> None:
        start.wait()
        try:
            stream = client.chat.completions.create(
                model="DeepSeek-V4.1-Flash", max_tokens=100, stream=True, extra_body={"ignore_eos": True},
                messages=[{"role": "user", "content": "hi"}])
            for _ in stream:  # all of it: the 100 tokens reserved are used, nothing comes back
                pass
            outcomes.append("served")
        except openai.RateLimitError:
            outcomes.append("429")

    try:
        gateway.wait_ready(1)
        threads = [threading.Thread(target=ask) for _ in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
    finally:
        gateway.stop()
        cluster.stop()
    # Each reserves its prompt (a few tokens) + 100 of the 300 a minute: two fit, never six.
    assert outcomes.count("served") == 2 and outcomes.count("429") == 4, outcomes
