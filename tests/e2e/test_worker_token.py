"""Workers closed by a shared token (sim-cluster and a gateway, real processes on loopback):
the gateway's calls (generate, probes, KV event polls) carry it; a call without it, or with a
wrong one, gets 401 and starts nothing; /health stays open; the token rotates with no failed
request; a worker beyond loopback without a token refuses to start."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from deepinfer_gateway.core.protocol import GENERATE_PATH, HEALTH_PATH, INFO_PATH, KV_EVENTS_PATH, LOAD_PATH
from deepinfer_gateway.gateway.upstream.http import TOKEN_REFRESH_S
from harness.launch import Gateway, SimCluster, free_port

MODEL = "DeepSeek-V4.1-Flash"
ADMIN_KEY = "admin-secret"
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}
GENERATE = {"request_id": "direct-1", "token_ids": list(range(1, 300)), "sampling": {"max_tokens": 4}}


def _rewrite(path: Path, text: str) -> None:
    """Replace a token file as a Secret update does (a new file renamed over), with a new mtime."""
    before = path.stat().st_mtime_ns if path.exists() else 0
    tmp = path.with_suffix(".new")
    tmp.write_text(text)
    os.utime(tmp, ns=(before + 1_000_000, before + 1_000_000))
    tmp.replace(path)


@pytest.fixture(scope="module")
def closed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[SimCluster, Gateway, Path, Path]]:
    tmp = tmp_path_factory.mktemp("token")
    worker_file, gateway_file = tmp / "worker-tokens", tmp / "gateway-token"
    worker_file.write_text("old-token\n")
    gateway_file.write_text("old-token\n")
    cluster = SimCluster("unified:sm100,unified:sm100", time_scale=20.0,
                         env={"DGW_WORKER_TOKEN_FILE": str(worker_file)})
    digest = hashlib.sha256(ADMIN_KEY.encode()).hexdigest()
    gateway = Gateway(tmp, [(url, "unified", "sm100") for url in cluster.urls],
                      extra_toml=f'[[api_keys]]\nname = "admin"\nkey_sha256 = "{digest}"\nadmin = true\n',
                      env={"DGW_WORKER_TOKEN_FILE": str(gateway_file)})
    try:
        gateway.wait_ready(2)  # the health probes carried the token
        yield cluster, gateway, worker_file, gateway_file
    finally:
        gateway.stop()
        cluster.stop()


def _chat(gateway: Gateway, content: str) -> httpx.Response:
    return httpx.post(gateway.url + "/v1/chat/completions", headers=ADMIN, timeout=30,
                      json={"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": content}]})


def _load(url: str, token: str) -> dict[str, Any]:
    reply = httpx.get(url + LOAD_PATH, headers={"authorization": f"Bearer {token}"}, timeout=5)
    assert reply.status_code == 200
    return reply.json()


def test_gateway_calls_carry_the_token(closed: tuple[SimCluster, Gateway, Path, Path]) -> None:
    cluster, gateway, _, _ = closed
    assert _chat(gateway, "a prompt long enough to fill a few KV blocks " * 20).status_code == 200
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the KV event polls carry it too: the index fills
        stats = httpx.get(gateway.url + "/admin/index", headers=ADMIN, timeout=5).json()
        if sum(w["memory_blocks"] for w in stats["workers"].values()) > 0:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the index never filled from the workers' events: {stats}")


def test_calls_without_the_token_get_401_and_start_nothing(closed: tuple[SimCluster, Gateway, Path, Path]) -> None:
    cluster, _, _, _ = closed
    url = cluster.urls[0]
    before = _load(url, "old-token")["prompt_tokens_total"]
    for headers in ({}, {"authorization": "Bearer wrong"}, {"x-api-key": "old-token"}):
        for method, path, body in (("POST", GENERATE_PATH, GENERATE), ("GET", INFO_PATH, None),
                                   ("GET", KV_EVENTS_PATH, None), ("POST", "/v1/chat/completions",
                                                                   {"model": MODEL, "messages": []})):
            reply = httpx.request(method, url + path, json=body, headers=headers, timeout=5)
            assert reply.status_code == 401, (path, headers, reply.text)
            assert reply.json()["error"]["kind"] == "unauthorized"
    assert _load(url, "old-token")["prompt_tokens_total"] == before  # no prompt reached the engine
    assert httpx.get(url + HEALTH_PATH, timeout=5).status_code == 200  # probes need no token


def test_rotation_drops_no_request(closed: tuple[SimCluster, Gateway, Path, Path]) -> None:
    cluster, gateway, worker_file, gateway_file = closed
    wait = TOKEN_REFRESH_S * 2 + 1.5  # the worker re-checks every second, the gateway every TOKEN_REFRESH_S
    statuses = []
    for step, (worker_tokens, gateway_tokens) in enumerate([
        ("old-token\nnew-token\n", "old-token\n"),  # 1. workers accept both
        ("old-token\nnew-token\n", "new-token\nold-token\n"),  # 2. the gateway sends the new one
        ("new-token\n", "new-token\n"),  # 3. the old one is gone
    ]):
        _rewrite(worker_file, worker_tokens)
        if step:
            _rewrite(gateway_file, gateway_tokens)
        end = time.monotonic() + wait
        while time.monotonic() < end:
            statuses.append(_chat(gateway, f"rotation step {step}").status_code)
    assert statuses and set(statuses) == {200}
    assert httpx.get(cluster.urls[0] + INFO_PATH, headers={"authorization": "Bearer old-token"},
                     timeout=5).status_code == 401
    assert _load(cluster.urls[0], "new-token")["worker_id"]


def test_a_tokenless_worker_beyond_loopback_refuses_to_start() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DGW_WORKER_TOKEN")}
    done = subprocess.run([sys.executable, "-m", "deepinfer_gateway", "worker", "--host", "0.0.0.0",
                           "--port", str(free_port())], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "DGW_WORKER_TOKEN" in done.stderr


def test_every_worker_kind_enforces_the_token(tmp_path: Path) -> None:
    """`worker --engine deepinfer` (on the LLMEngine double) and `worker --engine sim`, token
    from DGW_WORKER_TOKEN: 401 without it, /health open, and a gateway with it serves."""
    from harness.launch import CLI, Proc, wait_for_port
    from tests.deepinfer_double.serve import start_workers

    env = {"DGW_WORKER_TOKEN": "kind-token"}
    sim_port = free_port()
    sim = Proc(CLI + ["worker", "--engine", "sim", "--port", str(sim_port), "--time-scale", "20"], env=env)
    try:
        with start_workers([("unified", "sm100", [])], env=env) as deepinfer:
            wait_for_port(sim_port, timeout=30)
            urls = [deepinfer[0][0], f"http://127.0.0.1:{sim_port}"]
            for url in urls:
                assert httpx.get(url + INFO_PATH, timeout=5).status_code == 401
                assert httpx.post(url + GENERATE_PATH, json=GENERATE, timeout=5).status_code == 401
                assert httpx.get(url + HEALTH_PATH, timeout=5).status_code == 200
                assert httpx.get(url + INFO_PATH, headers={"authorization": "Bearer kind-token"},
                                 timeout=5).status_code == 200
            digest = hashlib.sha256(ADMIN_KEY.encode()).hexdigest()
            gateway = Gateway(tmp_path, [(url, "unified", "sm100") for url in urls], env=env,
                              extra_toml=f'[[api_keys]]\nname = "admin"\nkey_sha256 = "{digest}"\nadmin = true\n')
            try:
                gateway.wait_ready(2, timeout=60)
                for i in range(4):
                    assert _chat(gateway, f"kind {i}").status_code == 200
            finally:
                gateway.stop()
    finally:
        sim.stop()


def test_a_gateway_with_an_unreadable_token_file_is_a_config_error(tmp_path: Path) -> None:
    env = {**os.environ, "DGW_WORKER_TOKEN_FILE": str(tmp_path / "absent")}
    done = subprocess.run([sys.executable, "-m", "deepinfer_gateway", "serve", "--port", str(free_port())],
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "config error: worker_token_file: cannot read the token file" in done.stderr
