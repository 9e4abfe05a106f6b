"""Admin changes made on one gateway replica reach every replica sharing its Redis: workers
added and removed, routing policies, a replica started later, a replica that missed the
announcement; with Redis down, admin writes answer 503 and nothing changes."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from deepinfer_gateway.config import DgwWorkerSpec
from deepinfer_gateway.gateway.fleet.admin_store import KEPT_KEY, ROUTING_KEY, WORKERS_KEY, WorkerEntry
from deepinfer_gateway.gateway.fleet.admin_sync import RECONCILE_INTERVAL_S
from deepinfer_gateway.infra.redis_process import RedisProcess
from harness.launch import Gateway, SimCluster
from tests.conftest import redis_backend_url
from tests.fault_doubles import scrape, total

MODEL = "DeepSeek-V4.1-Flash"
ADMIN_KEY = "admin-secret"
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}
PROPAGATION_S = 5.0  # an announced change; a missed one is bounded by the reconcile interval


@pytest.fixture(scope="module")
def cluster() -> Iterator[SimCluster]:
    cluster = SimCluster("unified:sm100,unified:sm100", time_scale=20.0)
    yield cluster
    cluster.stop()


def _clear_admin_state(url: str, cluster: bool) -> None:
    client: Any = redis.RedisCluster.from_url(url) if cluster else redis.Redis.from_url(url)
    client.delete(WORKERS_KEY, ROUTING_KEY, KEPT_KEY)  # one slot: the keys share the hash tag
    client.close()


@pytest.fixture(params=["redis", "redis-cluster"])
def shared_redis(request: pytest.FixtureRequest) -> Iterator[tuple[str, bool]]:
    """A Redis URL and whether it is a cluster; the admin keys removed before and after (the
    server is the session's: a tombstone left behind would remove another test's worker)."""
    url, is_cluster = redis_backend_url(request, request.param), request.param == "redis-cluster"
    _clear_admin_state(url, is_cluster)
    yield url, is_cluster
    _clear_admin_state(url, is_cluster)


def _toml(redis_url: str, cluster: bool = False) -> str:
    digest = hashlib.sha256(ADMIN_KEY.encode()).hexdigest()
    # A generous Redis timeout: these tests count Redis errors, and a busy machine can pass the 0.5 s default.
    return (f'redis.url = "{redis_url}"\nredis.cluster = {str(cluster).lower()}\nredis.timeout_s = 10\n'
            'admin_worker_hosts = ["127.0.0.1"]\n'  # the second sim worker is added at run time
            f'[[api_keys]]\nname = "admin"\nkey_sha256 = "{digest}"\nadmin = true\n')


def _replica(tmp: Path, cluster: SimCluster, toml: str, healthy: int = 1) -> Gateway:
    gw = Gateway(tmp, [(cluster.urls[0], "unified", "sm100")], extra_toml=toml)
    gw.wait_ready(healthy)
    return gw


def _worker_ids(gw: Gateway) -> dict[str, bool]:
    r = httpx.get(gw.url + "/admin/workers", headers=ADMIN, timeout=10)
    assert r.status_code == 200, r.text
    return {w["id"]: w["healthy"] for w in r.json()["workers"]}


def _policy(gw: Gateway) -> str:
    r = httpx.get(gw.url + "/admin/routing", headers=ADMIN, timeout=10)
    assert r.status_code == 200, r.text
    return str(r.json()["policy"])


def _within(seconds: float, check: Callable[[], bool]) -> float:
    """Seconds until `check()` held; fails after `seconds`."""
    started = time.monotonic()
    while not check():
        assert time.monotonic() - started < seconds, f"not within {seconds} s"
        time.sleep(0.05)
    return time.monotonic() - started


def _routed_to(gw: Gateway, n: int) -> set[str]:
    """The ids of the workers that served n requests (clients read their client_id)."""
    workers = set()
    for i in range(n):
        r = httpx.post(gw.url + "/v1/chat/completions", headers=ADMIN, timeout=60, json={
            "model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": f"hello {i} {time.time()}"}]})
        assert r.status_code == 200, r.text
        workers.add(r.headers["x-dgw-worker"])
    listed = httpx.get(gw.url + "/admin/workers", headers=ADMIN, timeout=10).json()["workers"]
    return {w["id"] for w in listed if w["client_id"] in workers}


def _id(url: str) -> str:
    return url.split("://", 1)[1]


def test_admin_changes_reach_every_replica(cluster: SimCluster, shared_redis: tuple[str, bool],
                                          tmp_path: Path) -> None:
    url, is_cluster = shared_redis
    toml = _toml(url, is_cluster)
    static, added = _id(cluster.urls[0]), _id(cluster.urls[1])
    a, b = _replica(tmp_path, cluster, toml), _replica(tmp_path, cluster, toml)
    late: Gateway | None = None
    try:
        # Round-robin on A: B reports it, and alternates, so an added worker gets B's requests.
        r = httpx.put(a.url + "/admin/routing", headers=ADMIN, json={"policy": "round_robin"}, timeout=10)
        assert r.status_code == 200 and r.json()["policy"] == "round_robin", r.text
        _within(PROPAGATION_S, lambda: _policy(b) == "round_robin")

        r = httpx.post(a.url + "/admin/workers", headers=ADMIN, json={"url": cluster.urls[1]}, timeout=10)
        assert r.status_code == 201 and r.json() == {"id": added, "healthy": True, "shared": True}, r.text
        _within(PROPAGATION_S, lambda: _worker_ids(b).get(added) is True)
        assert _routed_to(b, 4) == {static, added}

        # A replica started after both changes has them before it serves (its port opens after
        # the lifespan loaded them: no wait for a reconcile round).
        late = _replica(tmp_path, cluster, toml)
        assert _policy(late) == "round_robin"
        assert _worker_ids(late) == {static: True, added: True}

        r = httpx.delete(a.url + f"/admin/workers/{added}", headers=ADMIN, timeout=10)
        assert r.status_code == 200 and r.json()["removed"] is True, r.text
        for gw in (b, late):
            _within(PROPAGATION_S, lambda gw=gw: added not in _worker_ids(gw))  # type: ignore[misc]
        assert _routed_to(b, 4) == {static}

        for gw in (a, b, late):  # everything went through Redis, without an error
            assert total(scrape(gw.url), "dgw_redis_errors_total", component="admin") == 0
    finally:
        for gw in (a, b, late):  # type: ignore[assignment]
            if gw is not None:
                gw.stop()


def test_a_replica_that_missed_the_announcement_converges(cluster: SimCluster, shared_redis: tuple[str, bool],
                                                        tmp_path: Path) -> None:
    """A change written to Redis without a message (as one sent while a replica was
    resubscribing): the periodic reconcile applies it; a tombstone removes a static worker."""
    url, is_cluster = shared_redis
    gw = _replica(tmp_path, cluster, _toml(url, is_cluster))
    client: Any = redis.RedisCluster.from_url(url) if is_cluster else redis.Redis.from_url(url)
    try:
        spec = DgwWorkerSpec(url=cluster.urls[1])
        client.hset(WORKERS_KEY, spec.worker_id, WorkerEntry(spec=spec).model_dump_json())
        _within(RECONCILE_INTERVAL_S + 3, lambda: _worker_ids(gw).get(spec.worker_id) is True)
        static = _id(cluster.urls[0])
        client.hset(WORKERS_KEY, static, WorkerEntry().model_dump_json())
        _within(RECONCILE_INTERVAL_S + 3, lambda: static not in _worker_ids(gw))
        assert _routed_to(gw, 3) == {spec.worker_id}
    finally:
        client.close()
        gw.stop()


def test_admin_writes_answer_503_while_redis_is_down(cluster: SimCluster, redis_server: RedisProcess,
                                                     tmp_path: Path) -> None:
    gw = _replica(tmp_path, cluster, _toml(redis_server.url))
    try:
        redis_server.stop()
        refused = [
            httpx.post(gw.url + "/admin/workers", headers=ADMIN, json={"url": cluster.urls[1]}, timeout=10),
            httpx.put(gw.url + "/admin/routing", headers=ADMIN, json={"policy": "round_robin"}, timeout=10),
            httpx.delete(gw.url + f"/admin/workers/{_id(cluster.urls[0])}", headers=ADMIN, timeout=10),
        ]
        for r in refused:
            assert r.status_code == 503, r.text
            error = r.json()["error"]
            assert error["code"] == "admin_state_unavailable" and "Redis" in error["message"], error
        # Nothing changed here either, and the replica still serves.
        assert _worker_ids(gw) == {_id(cluster.urls[0]): True}
        assert _policy(gw) != "round_robin"
        assert _routed_to(gw, 1) == {_id(cluster.urls[0])}
        time.sleep(RECONCILE_INTERVAL_S + 0.5)  # at least one failed reconcile and resubscribe, counted
        assert total(scrape(gw.url), "dgw_redis_errors_total", component="admin") >= 4

        redis_server.start()  # empty, same port: admin writes are accepted again
        def added() -> bool:
            r = httpx.post(gw.url + "/admin/workers", headers=ADMIN, json={"url": cluster.urls[1]}, timeout=10)
            return r.status_code == 201
        _within(PROPAGATION_S, added)
        assert _worker_ids(gw).get(_id(cluster.urls[1])) is True
    finally:
        gw.stop()
