"""Kubernetes discovery (gateway/fleet/kube_discovery.py) against an API server double over real
HTTPS on loopback (tests/kube_api_double.py: trustme's CA, bearer tokens, the API server's list
and watch wire format). No real kube-apiserver runs in these tests (none can be installed here);
the double answers as the documented API does. First the follower alone (list, watch, 410 Gone,
outages, token rotation, pool changes), then a real `serve` gateway and a real `epp` whose
[[discovery]] names the InferencePool, in front of real sim workers on loopback addresses."""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from deepinfer_gateway.config import DiscoverySpec
from deepinfer_gateway.gateway.fleet.endpoints import Endpoint, LookupFailed
from deepinfer_gateway.gateway.fleet.kube_api import ApiAccess, Backoff
from deepinfer_gateway.gateway.fleet.kube_discovery import KubernetesLookup
from harness.launch import CLI, Epp, Gateway, Proc, free_port
from tests.e2e.test_discovery import wait_for_port_at
from tests.kube_api_double import NAMESPACE, PODS_PATH, POOL, POOLS_PATH, FakeApiServer, inference_pool, pod

MODEL = "DeepSeek-V4.1-Flash"


def entry(server: FakeApiServer, **overrides: Any) -> DiscoverySpec:
    fields: dict[str, Any] = {"kind": "kubernetes", "name": POOL, "namespace": NAMESPACE, "api_server": server.url,
                              "token_file": str(server.token_file), "ca_file": str(server.ca_file),
                              "interval_s": 0.2, "drain_timeout_s": 5.0}
    return DiscoverySpec(**{**fields, **overrides})


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[FakeApiServer]:
    api = FakeApiServer(tmp_path)
    await api.start()
    yield api
    await api.stop()


async def eventually(check: Callable[[], bool], what: str, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if check():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"not within {seconds}s: {what}")


async def resolves_to(lookup: KubernetesLookup, hosts: set[str], port: int = 8100, seconds: float = 5.0) -> float:
    """Waits (on the lookup's change signal) until it answers `hosts`; the seconds it took."""
    started = time.monotonic()
    while True:
        found = await lookup.resolve()
        if found == {Endpoint(h, port) for h in hosts}:
            return time.monotonic() - started
        left = seconds - (time.monotonic() - started)
        assert left > 0, (found, hosts)
        await lookup.changed(left)


def fast() -> Backoff:
    return Backoff(first_s=0.05, max_s=0.2)


async def test_follows_the_pools_pods_through_list_watch_and_relist(server: FakeApiServer) -> None:
    server.set_pool(inference_pool(8100))
    server.set_pod(pod("a", "10.0.0.1"))
    server.set_pod(pod("b", "10.0.0.2", ready=False))
    server.set_pod(pod("other", "10.0.0.9", labels={"app": "else"}))  # not selected
    lookup = KubernetesLookup(entry(server), backoff=fast())
    try:
        assert await lookup.resolve() == {Endpoint("10.0.0.1", 8100)}
        listed_at = str(server.version)  # nothing changed since the list
        lists = [s for s in server.seen if s.path == PODS_PATH and "watch" not in s.query]
        assert lists and lists[0].query["labelSelector"] == \
            "app.kubernetes.io/name=deepinfer-gateway,deepinfer.ai/inference-pool=deepseek-flash"
        assert {s.authorization for s in server.seen} == {"Bearer token-1"}
        await eventually(lambda: server.watches(PODS_PATH) == 1 and server.watches(POOLS_PATH) == 1, "watching")
        (watch,) = [s for s in server.seen if s.path == PODS_PATH and s.query.get("watch") == "1"]
        assert watch.query["resourceVersion"] == listed_at  # the watch goes on from the list
        assert watch.query["allowWatchBookmarks"] == "true" and int(watch.query["timeoutSeconds"]) > 0

        server.set_pod(pod("b", "10.0.0.2"))  # became ready: one watch event, no new list
        took = await resolves_to(lookup, {"10.0.0.1", "10.0.0.2"})
        assert took < 1.0  # the watch wakes the reader at once, not at its next interval
        server.set_pod(pod("c", "10.0.0.3"))
        server.delete_pod("a")
        server.bookmark()
        await resolves_to(lookup, {"10.0.0.2", "10.0.0.3"})

        # etcd compacted; meanwhile c went away unseen: the watch's 410 makes the follower list
        # again (with the token rotated by the kubelet in between: the new one is sent).
        server.token_file.write_text("token-2\n")
        server.tokens = {"token-2"}
        lists_before = sum(1 for s in server.seen if s.path == PODS_PATH and "watch" not in s.query)
        server.compact(silently_deleted="c")
        await resolves_to(lookup, {"10.0.0.2"})
        assert sum(1 for s in server.seen if s.path == PODS_PATH and "watch" not in s.query) == lists_before + 1
        assert server.seen[-1].authorization == "Bearer token-2"
    finally:
        await lookup.aclose()


async def test_a_watch_the_server_ends_resumes_or_lists_again(server: FakeApiServer) -> None:
    server.set_pool(inference_pool(8100))
    server.set_pod(pod("a", "10.0.0.1"))
    lookup = KubernetesLookup(entry(server), backoff=fast())

    def pod_requests(watching: bool) -> list[Any]:
        return [s for s in server.seen if s.path == PODS_PATH and ("watch" in s.query) == watching]

    def lists_reach(n: int) -> Callable[[], bool]:
        return lambda: len(pod_requests(False)) == n

    try:
        assert await lookup.resolve() == {Endpoint("10.0.0.1", 8100)}
        await eventually(lambda: server.watches(PODS_PATH) == 1, "watching")
        server.set_pod(pod("b", "10.0.0.2"))
        await resolves_to(lookup, {"10.0.0.1", "10.0.0.2"})
        seen_version = str(server.version)
        server.end_watches()  # timeoutSeconds: resumed from the last version seen, no list
        await eventually(lambda: len(pod_requests(True)) == 2 and server.watches(PODS_PATH) == 1, "watching again")
        assert pod_requests(True)[-1].query["resourceVersion"] == seen_version and len(pod_requests(False)) == 1
        server.set_pod(pod("c", "10.0.0.3"))
        await resolves_to(lookup, {"10.0.0.1", "10.0.0.2", "10.0.0.3"})
        for as_status in (False, True):  # ended, and history gone by the time it resumes: 410, then a list
            lists = len(pod_requests(False))
            await eventually(lambda: server.watches(PODS_PATH) == 1, "watching")
            server.end_watches(compact=True, gone_as_status=as_status)
            await eventually(lists_reach(lists + 1), f"a new list (410 as status: {as_status})")
        assert await lookup.resolve() == {Endpoint(h, 8100) for h in ("10.0.0.1", "10.0.0.2", "10.0.0.3")}
    finally:
        await lookup.aclose()


async def test_an_outage_keeps_the_pool_and_backs_off(server: FakeApiServer) -> None:
    server.set_pool(inference_pool(8100))
    server.set_pod(pod("a", "10.0.0.1"))
    lookup = KubernetesLookup(entry(server), backoff=fast())
    try:
        assert await lookup.resolve() == {Endpoint("10.0.0.1", 8100)}
        await eventually(lambda: server.watches(PODS_PATH) == 1, "watching")
        server.fail_lists = 4  # the lists after the 410 fail: the last endpoints stay
        server.compact()
        await eventually(lambda: server.fail_lists == 0, "four failed lists")
        assert await lookup.resolve() == {Endpoint("10.0.0.1", 8100)}
        server.set_pod(pod("b", "10.0.0.2"))  # seen by the list that succeeds
        await resolves_to(lookup, {"10.0.0.1", "10.0.0.2"})
        stamps = [s for s in server.seen if s.path == PODS_PATH and "watch" not in s.query]
        assert len(stamps) >= 6  # first list, four refused, one answered
    finally:
        await lookup.aclose()


async def test_a_pool_change_or_deletion_moves_the_endpoints(server: FakeApiServer) -> None:
    lookup = KubernetesLookup(entry(server), backoff=fast())
    try:
        assert await lookup.resolve() == set()  # no pool yet: an answer of nothing
        server.set_pod(pod("a", "10.0.0.1"))
        await eventually(lambda: server.watches(POOLS_PATH) == 1, "waiting for the pool")
        server.set_pool(inference_pool(8100))  # created: followed from its ADDED
        await resolves_to(lookup, {"10.0.0.1"})
        await eventually(lambda: server.watches(PODS_PATH) == 1, "watching pods")
        server.set_pool(inference_pool(8200))  # another targetPort
        await resolves_to(lookup, {"10.0.0.1"}, port=8200)
        server.set_pod(pod("x", "10.0.0.7", labels={"deepinfer.ai/inference-pool": "other"}))
        await eventually(lambda: server.watches(POOLS_PATH) == 1, "watching the pool again")
        server.set_pool(inference_pool(8200, labels={"deepinfer.ai/inference-pool": "other"}))  # another selector
        await resolves_to(lookup, {"10.0.0.7"}, port=8200)
        await eventually(lambda: server.watches(POOLS_PATH) == 1, "watching the pool again")
        server.set_pool(None)  # deleted
        await resolves_to(lookup, set())
    finally:
        await lookup.aclose()


async def test_no_answer_is_not_an_empty_pool(server: FakeApiServer, tmp_path: Path) -> None:
    """A server whose certificate the CA does not sign, or a refused token, gives no answer:
    LookupFailed (the discovery keeps its workers), never an empty set."""
    server.set_pool(inference_pool(8100))
    server.set_pod(pod("a", "10.0.0.1"))
    (tmp_path / "other").mkdir()
    other_ca = FakeApiServer(tmp_path / "other")
    for bad in (entry(server, ca_file=str(other_ca.ca_file)), entry(server, token_file=str(tmp_path / "none"))):
        lookup = KubernetesLookup(bad, backoff=fast())
        try:
            with pytest.raises(LookupFailed, match="no answer"):
                await lookup.resolve()
        finally:
            await lookup.aclose()
    server.tokens = set()
    lookup = KubernetesLookup(entry(server), backoff=fast())
    try:
        with pytest.raises(LookupFailed):
            await lookup.resolve()
        assert any(s.authorization == "Bearer token-1" for s in server.seen)  # sent, and refused
    finally:
        await lookup.aclose()


def test_in_cluster_access_from_the_service_account(tmp_path: Path) -> None:
    found = DiscoverySpec(kind="kubernetes", name=POOL, namespace="team-a")
    access = ApiAccess.of(found, {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"})
    assert access == ApiAccess("https://10.96.0.1:443", "/var/run/secrets/kubernetes.io/serviceaccount/token",
                               "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt", "team-a")
    v6 = ApiAccess.of(found, {"KUBERNETES_SERVICE_HOST": "fd00::1", "KUBERNETES_SERVICE_PORT": "443"})
    assert v6.base_url == "https://[fd00::1]:443"
    with pytest.raises(ValueError, match="api_server"):
        ApiAccess.of(found, {})


# ------------------------------------------------------------------ real gateway, real EPP, real workers

ADDRESSES = ["127.0.0.2", "127.0.0.3"]
ADMIN_KEY = "kube-admin"


@pytest.fixture
def workers() -> Iterator[int]:
    """Two sim workers on 127.0.0.2-3, one port: the pool's pods."""
    port = free_port()
    procs = [Proc(CLI + ["worker", "--host", host, "--port", str(port), "--time-scale", "20"]) for host in ADDRESSES]
    try:
        for host in ADDRESSES:
            wait_for_port_at(host, port)
        yield port
    finally:
        for proc in procs:
            proc.stop()


def discovery_toml(server: FakeApiServer) -> str:
    return (f'[[discovery]]\nkind = "kubernetes"\nname = "{POOL}"\nnamespace = "{NAMESPACE}"\n'
            f'api_server = "{server.url}"\ntoken_file = "{server.token_file}"\nca_file = "{server.ca_file}"\n'
            f"interval_s = 5.0\ndrain_timeout_s = 5.0\n")


def within(seconds: float, check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.05)
    raise AssertionError(f"not within {seconds}s: {what}")


def test_serve_routes_to_the_pools_ready_pods(tmp_path: Path, workers: int) -> None:
    api = FakeApiServer(tmp_path)
    api.pool = None
    with api.in_thread():
        api.set_pool(inference_pool(workers))
        api.set_pod(pod("w-2", ADDRESSES[0]))
        api.set_pod(pod("w-3", ADDRESSES[1], ready=False))
        digest = hashlib.sha256(ADMIN_KEY.encode()).hexdigest()
        gw = Gateway(tmp_path, [], extra_toml=f'[[api_keys]]\nname = "admin"\nkey_sha256 = "{digest}"\n'
                                              f'admin = true\n' + discovery_toml(api))
        try:
            def listed() -> set[str]:
                r = httpx.get(gw.url + "/admin/workers", headers={"authorization": f"Bearer {ADMIN_KEY}"}, timeout=10)
                assert r.status_code == 200, r.text
                return {w["id"] for w in r.json()["workers"] if w["healthy"]}

            within(15, lambda: listed() == {f"{ADDRESSES[0]}:{workers}"}, "the ready pod only")
            api.set_pod(pod("w-3", ADDRESSES[1]))  # ready now: one watch event
            within(5, lambda: listed() == {f"{a}:{workers}" for a in ADDRESSES}, "both pods")
            client = openai.OpenAI(base_url=gw.url + "/v1", api_key=ADMIN_KEY, max_retries=0)
            answer = client.chat.completions.create(model=MODEL, max_tokens=4,
                                                    messages=[{"role": "user", "content": "hello"}])
            assert answer.choices[0].message.content is not None
            api.delete_pod("w-2")  # gone: drained, then removed
            within(15, lambda: listed() == {f"{ADDRESSES[1]}:{workers}"}, "the deleted pod removed")
        finally:
            gw.stop()


def test_epp_reads_its_pool_from_the_api(tmp_path: Path, workers: int) -> None:
    api = FakeApiServer(tmp_path)
    with api.in_thread():
        api.set_pool(inference_pool(workers))
        api.set_pod(pod("w-2", ADDRESSES[0]))
        epp = Epp(tmp_path, [], extra_toml=discovery_toml(api))
        try:
            def healthy() -> set[str]:
                text = httpx.get(epp.url + "/metrics", timeout=5).text
                return {line.split('worker="', 1)[1].split('"', 1)[0] for line in text.splitlines()
                        if line.startswith("dgw_worker_healthy{") and line.endswith(" 1.0")}

            within(15, lambda: healthy() == {f"{ADDRESSES[0]}:{workers}"}, "the EPP's pool: the ready pod")
            api.set_pod(pod("w-3", ADDRESSES[1]))
            within(5, lambda: healthy() == {f"{a}:{workers}" for a in ADDRESSES}, "both pods")
        finally:
            epp.stop()
