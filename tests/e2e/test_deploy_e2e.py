"""Shipped deployments, run for real on loopback: a gateway process started from a deploy
file's own config and environment (only host, port, Redis address, worker addresses and the
mounted Secrets' paths moved to loopback and temporary files), a real Redis started with the
shipped redis.conf and the shipped ACL users (deploy/k8s/redis.yaml, their passwords
substituted), a real simulated cluster that requires the worker token, the real SDKs as clients."""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
import redis
import yaml

from deepinfer_gateway.config import load_settings
from deepinfer_gateway.infra.redis_process import RedisProcess
from harness.launch import CLI, Gateway, Proc, SimCluster, free_port, wait_for_port
from tests.conftest import _require_redis_server
from tests.fault_doubles import scrape, total
from tests.shipped_redis_users import acl_users, k8s_redis_args, server_args

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
MODEL = "DeepSeek-V4.1-Flash"
PD_WORKERS = "prefill:sm100,prefill:sm100,prefill:ascend950,decode:sm100,decode:sm100,decode:ascend950"


def _k8s_gateway() -> tuple[Path, dict[str, str]]:
    docs = [d for d in yaml.safe_load_all((K8S / "gateway.yaml").read_text()) if d]
    (deployment,) = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "gateway"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return K8S / "gateway.toml", {e["name"]: e["value"] for e in container["env"] if "value" in e}


def _compose_gateway() -> tuple[Path, dict[str, str]]:
    service = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())["services"]["gateway-1"]
    (mount,) = [v for v in service["volumes"] if v.split(":")[1] == service["command"][-1]]
    env = {k: re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", str(v)) for k, v in service["environment"].items()}
    return DEPLOY / mount.split(":")[0], env


SHIPPED = {"k8s": _k8s_gateway, "compose": _compose_gateway}


REDIS_PASSWORD = "e2e-" + secrets.token_hex(8)  # the gateway user's
REDIS_ADMIN_PASSWORD = "e2e-admin-" + secrets.token_hex(8)
WORKER_TOKEN = "e2e-" + secrets.token_hex(8)


@pytest.fixture(scope="module")
def secret_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The mounted Secrets' files: the Redis password and the worker token."""
    tmp = tmp_path_factory.mktemp("secrets-mounted")
    (tmp / "redis-password").write_text(REDIS_PASSWORD + "\n")
    (tmp / "worker-token").write_text(WORKER_TOKEN + "\n")
    return {"DGW_REDIS__PASSWORD_FILE": str(tmp / "redis-password"), "DGW_WORKER_TOKEN_FILE": str(tmp / "worker-token")}


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    """Redis as shipped: deploy/k8s/redis.conf and the ACL users of redis.yaml (no default user)."""
    _require_redis_server()
    users = server_args(acl_users(k8s_redis_args()), {"admin": REDIS_ADMIN_PASSWORD, "gateway": REDIS_PASSWORD})
    with RedisProcess(*users, password=REDIS_ADMIN_PASSWORD, username="admin",
                      config_file=K8S / "redis.conf") as server:
        yield server.url


def _admin(redis_url: str) -> redis.Redis:
    """The operator's connection: the shipped admin user."""
    return redis.Redis.from_url(redis_url, username="admin", password=REDIS_ADMIN_PASSWORD)


def _shipped_redis_url(shipped_url: str, redis_url: str) -> str:
    """The deploy file's Redis URL (its user) with the address of the loopback Redis."""
    address = redis_url.split("//")[1].split("/")[0]
    moved, n = re.subn(r"(?<=@)redis:6379(?=/)", address, shipped_url)
    assert n == 1, f"{shipped_url}: not redis://USER@redis:6379/DB"
    return moved


@pytest.fixture(scope="module")
def pd_cluster(secret_files: dict[str, str]) -> Iterator[SimCluster]:
    cluster = SimCluster(PD_WORKERS, time_scale=20.0,
                         env={"DGW_WORKER_TOKEN_FILE": secret_files["DGW_WORKER_TOKEN_FILE"]})
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module", params=sorted(SHIPPED))
def shipped_gateway(request: pytest.FixtureRequest, pd_cluster: SimCluster, redis_url: str,
                    secret_files: dict[str, str],
                    tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A shipped gateway config with its deploy file's environment (the k8s Deployment's, the
    compose service's); the worker URLs point at loopback workers of the same role and
    hardware, DGW_HOST/PORT/REDIS_URL at loopback."""
    shipped, shipped_env = SHIPPED[request.param]()
    text = shipped.read_text()
    free: dict[str, list[str]] = {}
    for url, spec in zip(pd_cluster.urls, pd_cluster.specs, strict=True):
        free.setdefault(spec, []).append(url)
    settings = load_settings(shipped, {"redis": {"url": redis_url}})
    for worker in settings.workers:
        text, n = re.subn(rf'(?m)^url = "{re.escape(worker.url)}"$',
                          f'url = "{free[f"{worker.role}:{worker.hardware}"].pop(0)}"', text)
        assert n == 1, worker.url
    if settings.discovery:  # cluster DNS names: the same pools as loopback workers (test_discovery.py: DNS)
        text, n = re.subn(r"(?ms)^\[\[discovery\]\]\n.*?(?=^\[|\Z)", "", text)
        assert n == len(settings.discovery)
        for found in settings.discovery:
            for url in free.pop(f"{found.role}:{found.hardware}"):
                text += f'\n[[workers]]\nurl = "{url}"\nrole = "{found.role}"\nhardware = "{found.hardware}"\n'
    config = tmp_path_factory.mktemp(request.param) / "gateway.toml"
    config.write_text(text)
    port = free_port()
    env = {**shipped_env, "DGW_HOST": "127.0.0.1", "DGW_PORT": str(port),
           "DGW_REDIS__URL": _shipped_redis_url(shipped_env["DGW_REDIS__URL"], redis_url)}
    assert set(secret_files) <= set(env), "the deploy file mounts the Redis password and the worker token"
    env.update(secret_files)
    if "DGW_SECRETS_DIR" in env:  # the optional key Secret, not created: an empty mount
        env["DGW_SECRETS_DIR"] = str(tmp_path_factory.mktemp("secrets"))
    log = config.with_name("gateway.log")
    with log.open("wb") as log_file:
        proc = Proc(CLI + ["serve", "--config", str(config)], env=env, stderr=log_file)
        try:
            wait_for_port(port, timeout=30)
            url = f"http://127.0.0.1:{port}"
            _wait_ready(url, healthy=len(pd_cluster.urls))
            GATEWAY_LOGS[url] = log
            yield url
        finally:
            proc.stop()


GATEWAY_LOGS: dict[str, Path] = {}  # a shipped gateway's URL: its stderr


def _wait_ready(url: str, healthy: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        conn = http.client.HTTPConnection(url.split("//")[1], timeout=2)
        try:
            conn.request("GET", "/ready")
            if json.loads(conn.getresponse().read())["healthy_workers"] >= healthy:
                return
        except OSError:
            pass
        finally:
            conn.close()
        time.sleep(0.05)
    raise TimeoutError(f"{url} never saw {healthy} healthy workers")


@pytest.fixture
def redis_key(redis_url: str) -> Iterator[str]:
    """A fresh API key stored in Redis the way docs/deploy.md says to add one."""
    key = "dgw-" + secrets.token_urlsafe(16)
    name = f"dgw:apikey:{hashlib.sha256(key.encode()).hexdigest()}"
    client = _admin(redis_url)
    client.hset(name, mapping={"name": "e2e-deploy", "workload_class": "chat"})
    yield key
    client.delete(name)
    client.close()


def test_compose_gateway_healthcheck_passes_on_a_gateway_and_fails_without_one(shipped_gateway: str) -> None:
    """The compose gateways' healthcheck command, run as Docker would (its port moved to the
    loopback gateway's)."""
    test = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())["services"]["gateway-1"]["healthcheck"]["test"]
    assert test[:2] == ["CMD", "python"]

    def check(port: int | str) -> int:
        argv = [sys.executable, *(a.replace("127.0.0.1:8000", f"127.0.0.1:{port}") for a in test[2:])]
        return subprocess.run(argv, capture_output=True, timeout=30).returncode

    assert check(shipped_gateway.rsplit(":", 1)[1]) == 0
    assert check(free_port()) != 0


def test_shipped_gateway_refuses_without_a_key_and_serves_a_key_from_redis(shipped_gateway: str,
                                                                          redis_key: str) -> None:
    host = shipped_gateway.split("//")[1]
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8})
    conn = http.client.HTTPConnection(host, timeout=30)
    conn.request("POST", "/v1/chat/completions", body, {"content-type": "application/json"})
    response = conn.getresponse()
    assert response.status == 401, response.read()
    assert json.loads(response.read())["error"]["message"] == "Missing or invalid API key."
    conn.close()

    with openai.OpenAI(base_url=shipped_gateway + "/v1", api_key="dgw-not-a-stored-key", max_retries=0) as client:
        with pytest.raises(openai.AuthenticationError):
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=8)
    with openai.OpenAI(base_url=shipped_gateway + "/v1", api_key=redis_key, max_retries=0) as client:
        answer = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}],
                                                max_tokens=8)
        assert answer.choices[0].finish_reason == "length" and answer.usage.completion_tokens == 8
    with anthropic.Anthropic(base_url=shipped_gateway, api_key="dgw-not-a-stored-key", max_retries=0) as claude:
        with pytest.raises(anthropic.AuthenticationError):
            claude.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "Hello"}])
    with anthropic.Anthropic(base_url=shipped_gateway, api_key=redis_key, max_retries=0) as claude:
        message = claude.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "Hello"}])
        assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 8


def _get_ready(conn: http.client.HTTPConnection) -> tuple[int, dict[str, object]]:
    conn.request("GET", "/ready")
    response = conn.getresponse()
    return response.status, json.loads(response.read())


def test_sigterm_turns_ready_503_while_a_stream_in_flight_completes(tmp_path: Path) -> None:
    """Real time (time_scale 1) so the stream outlives the drain delay: /ready answers 503
    `shutting_down` from SIGTERM on, on a keep-alive connection opened before it and on new
    ones; after the delay the port closes; the stream still ends with [DONE]."""
    delay_s = 2.0
    cluster = SimCluster("unified:sm100", time_scale=1.0)
    gateway = Gateway(tmp_path, [(cluster.urls[0], "unified", "sm100")],
                      extra_toml=f"shutdown_delay_s = {delay_s}\nshutdown_grace_s = 30")
    try:
        gateway.wait_ready(1)
        host = gateway.url.split("//")[1]
        probe = http.client.HTTPConnection(host, timeout=5)  # kept alive across the signal
        assert _get_ready(probe)[0] == 200

        stream = http.client.HTTPConnection(host, timeout=60)
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a long story."}],
                "stream": True, "max_tokens": 600, "ignore_eos": True}
        stream.request("POST", "/v1/chat/completions", json.dumps(body), {"content-type": "application/json"})
        response = stream.getresponse()
        assert response.status == 200
        assert response.readline().startswith(b"data: ")  # generating

        signalled = time.monotonic()
        os.kill(gateway.proc.proc.pid, signal.SIGTERM)
        answers = [_get_ready(probe)]  # the signal lands asynchronously: a request may pass first
        while answers[-1][0] == 200 and time.monotonic() - signalled < 1.0:
            answers.append(_get_ready(probe))
        assert answers[-1] == (503, {"status": "shutting_down", "healthy_workers": 1}), answers
        fresh = http.client.HTTPConnection(host, timeout=5)
        assert _get_ready(fresh)[0] == 503  # the port stays open for the delay
        fresh.close()

        refused_at = None
        while refused_at is None and time.monotonic() - signalled < delay_s + 5:
            try:
                socket.create_connection(("127.0.0.1", gateway.port), timeout=1).close()
                time.sleep(0.1)
            except ConnectionRefusedError:
                refused_at = time.monotonic() - signalled
        assert refused_at is not None and refused_at >= delay_s, refused_at

        rest = response.read()  # the stream carries on after the port closed
        finished_at = time.monotonic() - signalled
        assert rest.rstrip().endswith(b"data: [DONE]"), rest[-200:]
        assert b'"finish_reason":"length"' in rest
        assert finished_at > refused_at, (finished_at, refused_at)
        assert gateway.proc.proc.wait(timeout=30) == 0
    finally:
        gateway.stop()
        cluster.stop()


def test_shipped_workers_refuse_calls_without_the_gateway_token(shipped_gateway: str, pd_cluster: SimCluster) -> None:
    """The gateway reached every worker with the mounted token (all healthy); a caller without it does not."""
    from deepinfer_gateway.core.protocol import INFO_PATH

    for url in pd_cluster.urls:
        host = url.split("//")[1]
        for headers in ({}, {"authorization": "Bearer not-the-token"}):
            conn = http.client.HTTPConnection(host, timeout=5)
            conn.request("GET", INFO_PATH, headers=headers)
            assert conn.getresponse().status == 401
            conn.close()


def test_shipped_redis_refuses_the_default_user_and_commands_outside_the_gateways(redis_url: str) -> None:
    """No default user: a connection that names no user is refused whatever password it gives;
    the gateway's user runs its commands on its keys only, never an admin command, never a
    write to the API keys."""
    for password in (None, REDIS_PASSWORD, REDIS_ADMIN_PASSWORD):
        with redis.Redis.from_url(redis_url, password=password) as anonymous, \
                pytest.raises(redis.AuthenticationError):
            anonymous.ping()
    with redis.Redis.from_url(redis_url, username="gateway", password=REDIS_PASSWORD) as gateway:
        assert gateway.ping()
        assert gateway.hgetall("dgw:apikey:" + "0" * 64) == {}  # reads keys
        for refused in (("FLUSHALL",), ("CONFIG", "GET", "requirepass"), ("CONFIG", "SET", "appendonly", "no"),
                        ("KEYS", "*"), ("ACL", "LIST"), ("SCRIPT", "FLUSH"), ("SHUTDOWN",),
                        ("HSET", "dgw:apikey:" + "0" * 64, "admin", "true"),  # minting a key
                        ("SET", "not-the-gateways", "1"), ("SUBSCRIBE", "another-channel")):
            with pytest.raises(redis.exceptions.NoPermissionError):
                gateway.execute_command(*refused)
    with _admin(redis_url) as admin:
        admin.acl_log_reset()


def test_shipped_gateway_runs_on_its_redis_user_without_a_refused_command(shipped_gateway: str,
                                                                          redis_url: str) -> None:
    """Everything the gateway keeps in Redis, through its shipped user: API keys, rate limits and
    token budgets, the prefix index fed by KV events, in-flight bookings, stored Responses,
    conversations, background responses, an admin change; Redis's ACL LOG stays empty, no Redis
    error is counted or logged."""
    admin = _admin(redis_url)
    admin.acl_log_reset()
    key = "dgw-" + secrets.token_urlsafe(16)
    name = f"dgw:apikey:{hashlib.sha256(key.encode()).hexdigest()}"
    admin.hset(name, mapping={"name": "e2e-acl", "requests_per_minute": "1000", "tokens_per_minute": "1000000",
                              "admin": "true"})
    try:
        prompt = "You are a careful assistant. " * 40 + "Say hello."  # several KV blocks, sent twice
        with openai.OpenAI(base_url=shipped_gateway + "/v1", api_key=key, max_retries=0) as client:
            for _ in range(2):
                answer = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                                        max_tokens=8)
                assert answer.usage.completion_tokens == 8
            stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                                    max_tokens=8, stream=True)
            assert sum(1 for _ in stream) > 1
            stored = client.responses.create(model=MODEL, input="Remember me.", max_output_tokens=8, store=True)
            assert stored.to_dict()["store"] is True  # kept in Redis, not served unstored
            assert client.responses.retrieve(stored.id).id == stored.id
            # The stored turn read back (a refused read answers 503 store_unavailable, raised here).
            chained = client.responses.create(model=MODEL, input="And now?", max_output_tokens=8,
                                              previous_response_id=stored.id)
            assert chained.to_dict()["store"] is True
            client.responses.delete(chained.id)
            # Conversations and a background response, streamed, resumed and cancelled.
            conv = client.conversations.create(items=[{"role": "user", "content": "Hi."}], metadata={"k": "v"})
            client.conversations.update(conv.id, metadata={"k": "w"})
            turn = client.responses.create(model=MODEL, input="Again.", conversation=conv.id, max_output_tokens=8)
            listed = client.conversations.items.list(conv.id, order="asc").data
            assert [i.id for i in listed][-1] == turn.output[0].id
            client.conversations.items.delete(listed[0].id, conversation_id=conv.id)
            client.conversations.delete(conv.id)
            with client.responses.create(model=MODEL, input="Later.", background=True, stream=True,
                                         max_output_tokens=8) as events:
                first = next(iter(events))
            resumed = list(client.responses.retrieve(first.response.id, stream=True, starting_after=0))
            assert resumed[-1].type in ("response.completed", "response.incomplete")
            running = client.responses.create(model=MODEL, input="Long.", background=True, max_output_tokens=4000,
                                              extra_body={"ignore_eos": True})
            client.responses.cancel(running.id)
            client.responses.delete(running.id)
        with httpx.Client(base_url=shipped_gateway, headers={"authorization": f"Bearer {key}"}, timeout=10) as http:
            routing = http.get("/admin/routing")
            assert routing.status_code == 200, routing.text
            policy = routing.json()["policy"]  # set again as it is: other tests share this Redis
            policy = policy["name"] if isinstance(policy, dict) else policy
            changed = http.put("/admin/routing", json={"policy": policy})
            assert changed.status_code == 200, changed.text
        kept = {k.decode().split("}")[0] + "}" if k.startswith(b"{") else k.decode().split(":")[1]
                for k in admin.scan_iter(count=1000)}
        assert {"{dgw:kv}", "{dgw:resp}", "{dgw:conv}", "{dgw:admin}", "rl", "apikey"} <= kept, kept
        assert admin.acl_log() == []
        assert total(scrape(shipped_gateway), "dgw_redis_errors_total") == 0
        logged = GATEWAY_LOGS[shipped_gateway].read_text(errors="replace")
        assert "NOPERM" not in logged and "no permissions" not in logged, logged[-2000:]
    finally:
        admin.delete(name)
        admin.close()
