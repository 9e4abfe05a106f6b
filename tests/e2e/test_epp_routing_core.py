"""The EPP composes the routing core `serve` composes (gateway/routing_core.py), from the same
settings: a worker added on a gateway replica that shares its Redis, at a host
`admin_worker_hosts` lists, is one the EPP routes to as well (an admin sync built apart from
the gateway's, without the settings' allow-list, refused it)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from harness.launch import Epp, SimCluster
from tests.e2e.test_admin_shared import ADMIN, PROPAGATION_S, _clear_admin_state, _replica, _toml
from tests.e2e.test_epp_envoy import wait_ready
from tests.e2e.test_epp_stream import chat
from tests.epp_stream import ExtProcClient

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def shared_redis(redis_url: str) -> Iterator[str]:
    _clear_admin_state(redis_url, False)
    yield redis_url
    _clear_admin_state(redis_url, False)


def test_the_epp_routes_to_a_worker_added_on_a_gateway_replica(shared_redis: str, tmp_path: Path) -> None:
    cluster = SimCluster("unified:sm100,unified:sm100", time_scale=20.0)
    toml = _toml(shared_redis) + '[router]\npolicy = "round_robin"\n'
    gateway = epp = client = None
    try:
        gateway = _replica(tmp_path, cluster, toml)
        epp = Epp(tmp_path, [(cluster.urls[0], "unified", "sm100")], extra_toml=toml)
        wait_ready(epp)
        client = ExtProcClient(epp.grpc_port)
        static, added = (u.split("//", 1)[1] for u in cluster.urls)
        assert {client.request("/v1/chat/completions", chat(f"before {i}")).endpoints[0] for i in range(2)} \
            == {static}
        r = httpx.post(gateway.url + "/admin/workers", headers=ADMIN, json={"url": cluster.urls[1]}, timeout=10)
        assert r.status_code == 201, r.text
        picks: set[str] = set()
        deadline = time.monotonic() + PROPAGATION_S + 5  # the announcement, then a health check admits it
        while added not in picks:
            assert time.monotonic() < deadline, f"the EPP never picked the added worker (picks: {picks})"
            picks.add(client.request("/v1/chat/completions", chat(f"after {time.time()}")).endpoints[0])
            time.sleep(0.05)
    finally:
        if client is not None:
            client.close()
        if epp is not None:
            epp.stop()
        if gateway is not None:
            gateway.stop()
        cluster.stop()
