"""The Endpoint Picker's Kubernetes files (deploy/k8s/epp, through deploy/k8s-overlays/epp) as
an operator applies them, rendered by a real kustomize: each custom resource checked against its
CRD's own schema and CEL rules (tests/k8s_crd.py): the InferencePool against the CRD vendored
from the Gateway API Inference Extension release (deploy/k8s/epp/crds), the HTTPRoute against
Gateway API's, the SecurityPolicy and HTTPRouteFilter against Envoy Gateway's (tests/data/k8s-crds);
then the pieces wired to each other. The built-in kinds are validated by test_k8s_render.py."""

from __future__ import annotations

import copy
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from deepinfer_gateway.config import GatewaySettings, load_settings
from deepinfer_gateway.epp.client_routes import CLIENT_ROUTES
from deepinfer_gateway.process.cli import build_parser
from tests.e2e.test_k8s_render import OVERLAYS, objects, render
from tests.k8s_crd import load_crd, problems

ROOT = Path(__file__).resolve().parents[2]
EPP = ROOT / "deploy" / "k8s" / "epp"
CRDS = {
    "InferencePool": EPP / "crds" / "inferencepools.inference.networking.k8s.io.yaml",
    "HTTPRoute": ROOT / "tests" / "data" / "k8s-crds" / "gateway.networking.k8s.io_httproutes.yaml.gz",
    "SecurityPolicy": ROOT / "tests" / "data" / "k8s-crds" / "gateway.envoyproxy.io_securitypolicies.yaml.gz",
    "HTTPRouteFilter": ROOT / "tests" / "data" / "k8s-crds" / "gateway.envoyproxy.io_httproutefilters.yaml.gz",
}
ENVOY_PROXIES = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "envoy-gateway-system"}},
                 "podSelector": {"matchLabels": {"app.kubernetes.io/name": "envoy",
                                                 "app.kubernetes.io/managed-by": "envoy-gateway"}}}


@pytest.fixture(scope="module")
def docs() -> list[dict[str, Any]]:
    return objects(render(OVERLAYS["epp"]))


def one(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    (found,) = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    return found


def pod_labels(workload: dict[str, Any]) -> dict[str, str]:
    return dict(workload["spec"]["template"]["metadata"]["labels"])


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


@pytest.mark.parametrize("kind", sorted(CRDS))
def test_each_custom_resource_is_admitted_by_its_crd(docs: list[dict[str, Any]], kind: str) -> None:
    found = [d for d in docs if d["kind"] == kind]
    assert found, kind
    crd = load_crd(CRDS[kind])
    for obj in found:
        assert problems(crd, obj) == [], obj["metadata"]["name"]


def test_the_vendored_crd_is_ginfs_v1_inferencepool() -> None:
    crd = load_crd(CRDS["InferencePool"])
    assert crd["metadata"]["name"] == "inferencepools.inference.networking.k8s.io"
    assert crd["metadata"]["annotations"]["inference.networking.k8s.io/bundle-version"].startswith("v1.")
    assert [v["name"] for v in crd["spec"]["versions"] if v["served"] and v["storage"]] == ["v1"]
    header = CRDS["InferencePool"].read_text().split("apiVersion:", 1)[0]
    assert "kubernetes-sigs/gateway-api-inference-extension" in header and "Apache License" in header
    assert "Apache License" in (EPP / "crds" / "LICENSE").read_text()


def test_the_crd_refuses_a_broken_inference_pool(docs: list[dict[str, Any]]) -> None:
    """The checks can fail: each breakage below is one the API server refuses."""
    crd = load_crd(CRDS["InferencePool"])
    pool = one(docs, "InferencePool")
    cases: dict[str, tuple[Any, str]] = {
        "unknown field": (lambda s: s.update(targetPort=8100), "'targetPort' was unexpected"),
        "failure mode": (lambda s: s["endpointPickerRef"].update(failureMode="FailSometimes"), "FailSometimes"),
        "no selector": (lambda s: s.pop("selector"), "'selector' is a required property"),
        "Service without port (CEL)": (lambda s: s["endpointPickerRef"].pop("port"), "port is required"),
        "repeated port (CEL)": (lambda s: s.update(targetPorts=[{"number": 8100}, {"number": 8100}]),
                                "port number must be unique"),
    }
    for name, (breakage, message) in cases.items():
        broken = copy.deepcopy(pool)
        breakage(broken["spec"])
        found = problems(crd, broken)
        assert any(message in p for p in found), (name, found)


def test_the_pool_selects_the_workers_and_names_the_epp(docs: list[dict[str, Any]]) -> None:
    pool = one(docs, "InferencePool")["spec"]
    workers = one(docs, "Deployment", "unified-sm100")
    assert selects(pool["selector"]["matchLabels"], pod_labels(workers))
    # Nothing else of the namespace is in the pool (the PD workers, the gateway, the EPP).
    others = [d for d in docs if d["kind"] in ("Deployment", "StatefulSet") and d is not workers]
    assert others and not any(selects(pool["selector"]["matchLabels"], pod_labels(d)) for d in others)
    (container,) = workers["spec"]["template"]["spec"]["containers"]
    assert [{"number": p["containerPort"]} for p in container["ports"]] == pool["targetPorts"]
    ref = pool["endpointPickerRef"]
    assert ref.get("kind", "Service") == "Service" and ref["failureMode"] == "FailClose"
    service = one(docs, "Service", ref["name"])
    epp = one(docs, "Deployment", "epp")
    assert selects(service["spec"]["selector"], pod_labels(epp))
    (port,) = [p for p in service["spec"]["ports"] if p["port"] == ref["port"]["number"]]
    (c,) = epp["spec"]["template"]["spec"]["containers"]
    assert {p["name"]: p["containerPort"] for p in c["ports"]}[port["targetPort"]] == 9002
    assert port["appProtocol"] == "kubernetes.io/h2c"  # gRPC, in clear behind the NetworkPolicy


def test_the_route_sends_the_pool_authenticated_traffic_only(docs: list[dict[str, Any]]) -> None:
    route = one(docs, "HTTPRoute")
    (rule,) = route["spec"]["rules"]
    assert rule["backendRefs"] == [{"group": "inference.networking.k8s.io", "kind": "InferencePool",
                                    "name": one(docs, "InferencePool")["metadata"]["name"]}]
    # The client APIs alone, as the EPP routes them: never the workers' protocol, which the
    # token this route injects would open to every client.
    assert all(m["path"]["type"] == "Exact" for m in rule["matches"])
    routed = {(m["path"]["value"], m["method"]) for m in rule["matches"]}
    assert routed == {(path, method) for path, methods in CLIENT_ROUTES.items() for method in methods}
    (ext,) = [f["extensionRef"] for f in rule["filters"] if f["type"] == "ExtensionRef"]
    injected = one(docs, ext["kind"], ext["name"])["spec"]["credentialInjection"]
    assert injected["overwrite"] is True and injected["credential"]["valueRef"]["kind"] == "Secret"
    policy = one(docs, "SecurityPolicy")["spec"]
    assert policy["targetRefs"] == [{"group": "gateway.networking.k8s.io", "kind": "HTTPRoute",
                                     "name": route["metadata"]["name"]}]
    assert policy["apiKeyAuth"]["credentialRefs"] and policy["apiKeyAuth"]["sanitize"] is True
    # No key committed: the Secrets the two resources name are created by the operator.
    secrets = {d["metadata"]["name"] for d in docs if d["kind"] == "Secret"}
    assert not secrets & {injected["credential"]["valueRef"]["name"],
                          *(r["name"] for r in policy["apiKeyAuth"]["credentialRefs"])}


def test_epp_deployment_ports_probes_and_identity(docs: list[dict[str, Any]]) -> None:
    epp = one(docs, "Deployment", "epp")
    spec = epp["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {
        "grpc-ext-proc": 9002, "grpc-health": 9003, "http-metrics": 9090}
    assert c["readinessProbe"]["grpc"] == {"port": 9003, "service": "readiness"}
    assert c["livenessProbe"]["grpc"] == {"port": 9003, "service": "liveness"}
    assert c["startupProbe"]["grpc"]["port"] == 9003
    args = c["args"]
    parsed = build_parser().parse_args(args)
    assert (parsed.command, parsed.grpc_host, parsed.metrics_host) == ("epp", "0.0.0.0", "0.0.0.0")
    flags = dict(zip(args[1::2], args[2::2], strict=True))
    assert (flags["--grpc-port"], flags["--health-port"], flags["--metrics-port"]) == ("9002", "9003", "9090")
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert {"cpu", "memory"} <= set(c["resources"]["requests"]) & set(c["resources"]["limits"])
    # Only this pod gets an API token: the service account does not mount one by default.
    account = one(docs, "ServiceAccount", spec["serviceAccountName"])
    assert account["automountServiceAccountToken"] is False and spec["automountServiceAccountToken"] is True
    binding = one(docs, "RoleBinding", "epp")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["metadata"]["name"],
                                    "namespace": epp["metadata"]["namespace"]}]
    role = one(docs, "Role", binding["roleRef"]["name"])
    assert {(g, r): sorted(rule["verbs"]) for rule in role["rules"] for g in rule["apiGroups"]
            for r in rule["resources"]} == {("", "pods"): ["get", "list", "watch"],
                                            ("inference.networking.k8s.io", "inferencepools"): ["get", "watch"]}
    config_map = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("epp-config-"))
    assert {"name": "config", "configMap": {"name": config_map["metadata"]["name"]}} in spec["volumes"]
    assert flags["--config"] == "/etc/deepinfer-gateway/epp.toml" and "epp.toml" in config_map["data"]


def test_epp_config_follows_the_pool_through_the_api(docs: list[dict[str, Any]],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    for name in GatewaySettings.model_fields:
        monkeypatch.delenv(f"DGW_{name.upper()}", raising=False)
    config_map = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("epp-config-"))
    text = config_map["data"]["epp.toml"]
    assert text == (EPP / "epp.toml").read_text()
    tomllib.loads(text)
    settings = load_settings(EPP / "epp.toml", {"redis": {"url": "redis://redis:6379/0"}})
    (entry,) = settings.discovery
    assert entry.kind == "kubernetes" and entry.name == one(docs, "InferencePool")["metadata"]["name"]
    assert not settings.workers
    workers = one(docs, "Deployment", "unified-sm100")["spec"]["template"]["spec"]
    assert entry.drain_timeout_s >= workers["terminationGracePeriodSeconds"]


def test_only_the_gateway_reaches_the_epp_and_the_pool(docs: list[dict[str, Any]]) -> None:
    policies = [d["spec"] for d in docs if d["kind"] == "NetworkPolicy"]
    assert one(docs, "NetworkPolicy", "default-deny-ingress")["spec"] == {"podSelector": {}, "policyTypes": ["Ingress"]}
    epp = pod_labels(one(docs, "Deployment", "epp"))
    workers = pod_labels(one(docs, "Deployment", "unified-sm100"))

    def admitted(labels: dict[str, str]) -> dict[int, list[dict[str, Any]]]:
        out: dict[int, list[dict[str, Any]]] = {}
        for policy in policies:
            if selects(policy["podSelector"].get("matchLabels", {}), labels):
                for rule in policy.get("ingress", []):
                    assert rule.get("from"), "a rule without `from` opens its ports to every pod"
                    for port in rule["ports"]:
                        out.setdefault(port["port"], []).extend(rule["from"])
        return out

    to_epp = admitted(epp)
    assert to_epp[9002] == [ENVOY_PROXIES] and set(to_epp) == {9002, 9090}
    to_workers = admitted(workers)
    epp_peer = {"podSelector": {"matchLabels": {k: epp[k] for k in ("app.kubernetes.io/name",
                                                                   "app.kubernetes.io/component")}}}
    assert set(to_workers) == {8100} and ENVOY_PROXIES in to_workers[8100] and epp_peer in to_workers[8100]
    redis = pod_labels(one(docs, "StatefulSet", "redis"))
    assert epp_peer in admitted(redis)[6379]


def test_every_image_is_the_bases_one(docs: list[dict[str, Any]]) -> None:
    (entry,) = yaml.safe_load((ROOT / "deploy" / "k8s" / "kustomization.yaml").read_text())["images"]
    ours = {c["image"] for d in docs if d["kind"] in ("Deployment", "StatefulSet")
            for c in d["spec"]["template"]["spec"]["containers"] if "deepinfer-gateway" in c["image"]}
    assert ours == {f"{entry['newName']}:{entry['newTag']}"}
    assert one(docs, "Deployment", "epp")["spec"]["template"]["spec"]["containers"][0]["image"] in ours
