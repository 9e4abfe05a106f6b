"""A Redis that hangs (stopped with SIGSTOP: connections open, nothing answers) costs the
gateway's requests one socket timeout per Redis user and probe interval, not one per request;
once it answers again, the shared state is used again (a rate limit holds)."""

from __future__ import annotations

import hashlib
import os
import signal
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from harness.launch import Gateway, SimCluster
from tests.conftest import RedisServer

MODEL = "DeepSeek-V4.1-Flash"
KEY = "hung-redis-key"
LIMIT_RPM = 3


@pytest.fixture
def gateway(redis_server: RedisServer, tmp_path: Path) -> Iterator[Gateway]:
    cluster = SimCluster("unified:sm100")
    keys = (f'redis.url = "{redis_server.url}"\n[[api_keys]]\nname = "limited"\n'
            f'key_sha256 = "{hashlib.sha256(KEY.encode()).hexdigest()}"\nrequests_per_minute = {LIMIT_RPM}\n')
    gw = Gateway(tmp_path, [(url, "unified", "sm100") for url in cluster.urls], extra_toml=keys)
    try:
        gw.wait_ready(1)
        yield gw
    finally:
        gw.stop()
        cluster.stop()


def ask(client: openai.OpenAI, n: int) -> float:
    started = time.monotonic()
    client.chat.completions.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": f"q{n}"}])
    return time.monotonic() - started


def test_a_hung_redis_does_not_slow_every_request(gateway: Gateway, redis_server: RedisServer) -> None:
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=KEY, max_retries=0, timeout=30)
    assert redis_server.proc is not None
    os.kill(redis_server.proc.pid, signal.SIGSTOP)
    try:
        # The rate limit fails open meanwhile: more than LIMIT_RPM requests all pass.
        waits = [ask(client, n) for n in range(10)]
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)
    # Each Redis call on a request's path times out after 0.5 s: the first request pays for the
    # rate limiter and the in-flight totals, then one probe per second each.
    assert statistics.median(waits) < 0.3, waits
    time.sleep(1.2)  # past the probe interval: the next calls go to Redis again
    with pytest.raises(openai.RateLimitError):
        for n in range(LIMIT_RPM + 1):
            ask(client, 100 + n)
