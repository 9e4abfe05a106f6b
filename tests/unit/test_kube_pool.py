"""kube_pool.py: an InferencePool and its pods' objects and watch events -> the endpoint set."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from pydantic import ValidationError

from deepinfer_gateway.config import DiscoverySpec
from deepinfer_gateway.gateway.fleet.endpoints import Endpoint
from deepinfer_gateway.gateway.fleet.kube_api import Backoff
from deepinfer_gateway.gateway.fleet.kube_pool import (
    BadObject,
    PodSet,
    PoolSpec,
    WatchEvent,
    pod_endpoints,
    pool_spec,
    resource_version,
)

LABELS = {"app.kubernetes.io/name": "deepinfer-gateway", "deepinfer.ai/inference-pool": "deepseek-flash"}


def pool(**spec: Any) -> dict[str, Any]:
    body = {"selector": {"matchLabels": LABELS}, "targetPorts": [{"number": 8100}],
            "endpointPickerRef": {"name": "epp", "port": {"number": 9002}}}
    body.update(spec)
    return {"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
            "metadata": {"name": "deepseek-flash", "resourceVersion": "7"}, "spec": body}


def pod(name: str, ip: str | None = "10.0.0.1", ready: bool = True, terminating: bool = False,
        uid: str | None = None) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": name, "namespace": "ns", "uid": uid or f"uid-{name}", "resourceVersion": "9"}
    if terminating:
        metadata["deletionTimestamp"] = "2026-12-04T03:00:00Z"
    status: dict[str, Any] = {"phase": "Running", "conditions": [
        {"type": "PodScheduled", "status": "True"}, {"type": "Ready", "status": "True" if ready else "False"}]}
    if ip:
        status["podIP"] = ip
    return {"kind": "Pod", "metadata": metadata, "status": status}


def test_pool_spec_reads_selector_and_ports_in_order() -> None:
    spec = pool_spec(pool(targetPorts=[{"number": 8200}, {"number": 8100}]))
    assert spec == PoolSpec(tuple(sorted(LABELS.items())), (8200, 8100))
    assert spec.label_selector == "app.kubernetes.io/name=deepinfer-gateway,deepinfer.ai/inference-pool=deepseek-flash"


@pytest.mark.parametrize("broken", [
    {"selector": {}}, {"selector": {"matchLabels": {}}}, {"targetPorts": []}, {"targetPorts": [{"number": 0}]},
    {"targetPorts": [{"name": "http"}]}, {"selector": {"matchLabels": {"a": 1}}},
])
def test_a_pool_without_selector_or_ports_is_refused(broken: dict[str, Any]) -> None:
    with pytest.raises(BadObject, match="deepseek-flash"):
        pool_spec(pool(**broken))


def test_resource_version_is_required() -> None:
    assert resource_version(pool()) == "7"
    with pytest.raises(BadObject, match="resourceVersion"):
        resource_version({"kind": "PodList", "metadata": {}})


def test_only_a_ready_pod_with_an_ip_not_terminating_serves() -> None:
    ports = (8100, 8101)
    assert pod_endpoints(pod("a"), ports) == {Endpoint("10.0.0.1", 8100), Endpoint("10.0.0.1", 8101)}
    assert pod_endpoints(pod("a", ready=False), ports) == set()
    assert pod_endpoints(pod("a", ip=None), ports) == set()  # scheduled, no IP yet
    assert pod_endpoints(pod("a", terminating=True), ports) == set()
    assert pod_endpoints({"metadata": {"name": "a"}}, ports) == set()  # no status at all
    assert pod_endpoints(pod("a", ip="fd00::5"), (8100,)) == {Endpoint("fd00::5", 8100)}
    assert Endpoint("fd00::5", 8100).url("http") == "http://[fd00::5]:8100"


def test_pod_set_follows_a_list_then_the_events() -> None:
    pods = PodSet((8100,))
    pods.replace([pod("a", "10.0.0.1"), pod("b", "10.0.0.2", ready=False)])
    assert pods.endpoints() == {Endpoint("10.0.0.1", 8100)}
    steps: list[tuple[str, dict[str, Any], set[str]]] = [
        ("MODIFIED", pod("b", "10.0.0.2"), {"10.0.0.1", "10.0.0.2"}),          # b became ready
        ("ADDED", pod("c", None), {"10.0.0.1", "10.0.0.2"}),                   # c scheduled, no IP
        ("MODIFIED", pod("c", "10.0.0.3"), {"10.0.0.1", "10.0.0.2", "10.0.0.3"}),
        ("MODIFIED", pod("a", "10.0.0.1", terminating=True), {"10.0.0.2", "10.0.0.3"}),  # draining
        ("DELETED", pod("a", "10.0.0.1", terminating=True), {"10.0.0.2", "10.0.0.3"}),
        ("BOOKMARK", {"kind": "Pod", "metadata": {"resourceVersion": "12"}}, {"10.0.0.2", "10.0.0.3"}),
        # b replaced by a new pod of the same name on the same IP (another uid): the old one's
        # DELETED after the new one's ADDED must not take the address away
        ("ADDED", pod("b", "10.0.0.2", uid="uid-b2"), {"10.0.0.2", "10.0.0.3"}),
        ("DELETED", pod("b", "10.0.0.2"), {"10.0.0.2", "10.0.0.3"}),
        ("DELETED", pod("c", "10.0.0.3"), {"10.0.0.2"}),
    ]
    for kind, obj, hosts in steps:
        pods.apply(WatchEvent(kind, obj))
        assert {e.host for e in pods.endpoints()} == hosts, (kind, obj["metadata"])
    pods.replace([])  # a re-list that finds none
    assert pods.endpoints() == set()


def test_watch_lines_parse_and_410_is_expired() -> None:
    event = WatchEvent.parse(json.dumps({"type": "ADDED", "object": pod("a")}).encode() + b"\n")
    assert event.type == "ADDED" and not event.expired
    gone = WatchEvent.parse(json.dumps({"type": "ERROR", "object": {
        "kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Expired", "code": 410,
        "message": "too old resource version: 5 (17)"}}))
    assert gone.expired and gone.error() == "410 Expired: too old resource version: 5 (17)"
    other = WatchEvent.parse(json.dumps({"type": "ERROR", "object": {"code": 500, "message": "etcd"}}))
    assert not other.expired
    for line in (b"not json", b"[]", b'{"type": "ADDED"}', b'{"object": {}}'):
        with pytest.raises(BadObject, match="watch"):
            WatchEvent.parse(line)


def test_backoff_grows_with_jitter_to_its_cap_and_resets() -> None:
    backoff = Backoff(first_s=0.5, max_s=4.0, rng=random.Random(1))
    waits = [backoff.next() for _ in range(6)]
    for wait, ceiling in zip(waits, [0.5, 1.0, 2.0, 4.0, 4.0, 4.0], strict=True):
        assert ceiling / 2 <= wait <= ceiling
    backoff.reset()
    assert backoff.next() <= 0.5


def test_discovery_entry_kinds_keep_their_own_fields() -> None:
    entry = DiscoverySpec(kind="kubernetes", name="deepseek-flash", namespace="ns")
    assert entry.token_file.endswith("/serviceaccount/token") and entry.ca_file.endswith("/serviceaccount/ca.crt")
    assert DiscoverySpec(name="pool.example").kind == "dns"
    with pytest.raises(ValidationError, match="port: dns only"):
        DiscoverySpec(kind="kubernetes", name="deepseek-flash", port=8100)
    with pytest.raises(ValidationError, match="nameservers, srv: dns only"):
        DiscoverySpec(kind="kubernetes", name="deepseek-flash", srv=True, nameservers=("127.0.0.1",))
    with pytest.raises(ValidationError, match="api_server, namespace: kubernetes only"):
        DiscoverySpec(name="pool.example", namespace="ns", api_server="https://127.0.0.1:6443")
    with pytest.raises(ValidationError, match="kind"):
        DiscoverySpec(kind="consul", name="x")
