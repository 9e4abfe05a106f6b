"""Several gateway replicas sharing one Redis make the same decisions: the prefix index,
and in-flight reservations so a burst split across replicas does not herd."""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from harness.launch import Gateway, SimCluster
from tests.conftest import redis_backend_url
from tests.fault_doubles import scrape, total

MODEL = "DeepSeek-V4.1-Flash"


@pytest.fixture(scope="module")
def unified_cluster() -> Iterator[SimCluster]:
    cluster = SimCluster("unified:sm100,unified:sm100,unified:sm100", time_scale=5.0)
    yield cluster
    cluster.stop()


def _replicas(tmp: Path, cluster: SimCluster, redis_url: str, health_interval_s: float,
              redis_cluster: bool = False) -> list[Gateway]:
    workers = [(url, *spec.split(":")) for url, spec in zip(cluster.urls, cluster.specs, strict=True)]
    # A generous Redis timeout: the tests count Redis errors, and a busy machine can pass the 0.5 s default.
    toml = f'redis.url = "{redis_url}"\nredis.cluster = {str(redis_cluster).lower()}\nredis.timeout_s = 10'
    gateways = [Gateway(tmp, workers, extra_toml=toml, health_interval_s=health_interval_s) for _ in range(2)]
    for gw in gateways:
        gw.wait_ready(len(workers))
    return gateways


def _chat(gw: Gateway, content: str, max_tokens: int = 4) -> httpx.Response:
    r = httpx.post(gw.url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "max_tokens": max_tokens, "messages": [{"role": "user", "content": content}]})
    assert r.status_code == 200, r.text
    return r


@pytest.mark.parametrize("backend", ["redis", "redis-cluster"])
def test_second_replica_routes_to_the_worker_that_cached_the_prefix(
        unified_cluster: SimCluster, backend: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """With one Redis, and with a Redis Cluster (index, reservations and limits then live on
    whichever nodes own their hash tags)."""
    url = redis_backend_url(request, backend)
    a, b = _replicas(tmp_path, unified_cluster, url, 0.2, redis_cluster=backend == "redis-cluster")
    try:
        shared = " ".join(f"clause {i} of the shared contract." for i in range(600))
        first = _chat(a, shared + " Question A")
        time.sleep(0.5)  # worker KV events -> replica A's feeder -> Redis (and B's feeder too)
        for i in range(3):
            second = _chat(b, shared + f" Question B{i}")
            assert second.headers["x-dgw-worker"] == first.headers["x-dgw-worker"]
            usage = second.json()["usage"]
            assert usage["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"] - 256
        deferred = 0.0
        for gw in (a, b):  # all of it went through Redis: no replica fell back to its own view
            samples = scrape(gw.url)
            assert total(samples, "dgw_kv_index_errors_total") == 0
            assert total(samples, "dgw_redis_errors_total") == 0
            deferred += total(samples, "dgw_kv_index_writes_deferred_total")
        assert deferred >= 1  # both polled the worker; the one without its write lease left Redis alone
    finally:
        for gw in (a, b):
            gw.stop()


def test_replicas_see_each_others_in_flight_prompts(redis_url: str, tmp_path: Path) -> None:
    """Requests alternate between two replicas while earlier ones are still prefilling: with
    shared reservations each lands on a different worker; a replica blind to its peer would
    send the second one to the first one's worker (same stale load reports, same costs)."""
    # At a fifth of real time a prefill lasts ~1.5 s, so each request's reservation is booked (its
    # gateway tokenizes 100k tokens first: slow on a busy machine) well before the next one is
    # routed 0.4 s later, and the first is still prefilling when the third is routed.
    cluster = SimCluster("unified:sm100,unified:sm100,unified:sm100", time_scale=0.2)
    a, b = _replicas(tmp_path, cluster, redis_url, 30.0)  # load reports every 30 s: stale
    try:
        for gw in (a, b):  # a replica's first request pays for warming up: not in the 0.4 s below
            _chat(gw, "warm up", 1)
        prompts = [f"cold {i} " + "wide prompt text " * 25_000 for i in range(3)]  # ~100k tokens
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            futures = []
            for i, prompt in enumerate(prompts):
                futures.append(pool.submit(_chat, (a, b)[i % 2], prompt, 1))
                time.sleep(0.4)
            workers = [f.result().headers["x-dgw-worker"] for f in futures]
        assert len(set(workers)) == 3, workers
    finally:
        for gw in (a, b):
            gw.stop()
        cluster.stop()
