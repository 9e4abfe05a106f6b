"""Durable and rebuildable state across a Redis crash (real Redis started with the shipped
deploy/k8s/redis.conf and a password, real sim workers behind a worker token, real gateways):

- Redis SIGKILLed and restarted on its data directory: an API key stored in Redis still
  authenticates, the admin changes (a worker added, a routing policy) are still there, on a
  gateway replica started afterwards too (a replaced replica), and the prefix index in Redis
  is refilled from the workers without any new request (`/admin/index`).
- Redis stopped with SIGTERM (a node drained): a write made just before is kept.
- Redis restarted with its data directory lost: the admin changes are written back from a
  running replica, the index is refilled, and the keys configured in the gateway's settings
  (the Secret) keep working; the keys that were only in Redis are gone, as docs/deploy.md says.
"""

from __future__ import annotations

import hashlib
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import redis

from deepinfer_gateway.gateway.fleet.admin_store import KEPT_KEY, WORKERS_KEY
from deepinfer_gateway.infra.redis_process import RedisProcess
from harness.launch import Gateway, SimCluster
from tests.conftest import _require_redis_server

MODEL = "DeepSeek-V4.1-Flash"
SHIPPED_CONF = Path(__file__).parents[2] / "deploy" / "k8s" / "redis.conf"
PASSWORD = "redis-secret"
ADMIN_KEY, CLIENT_KEY = "admin-secret", "client-key-in-redis"
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}
REFILL_S = 10.0  # the feeders poll each worker at least every second (long poll), then resync


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _chat(gw: Gateway, key: str, content: str = "hello") -> httpx.Response:
    return httpx.post(gw.url + "/v1/chat/completions", headers={"authorization": f"Bearer {key}"}, timeout=30,
                      json={"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": content}]})


def _until(check: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        found = check()
        if found:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout}s")
        time.sleep(0.1)


def _redis_blocks(gw: Gateway) -> int:
    stats = httpx.get(gw.url + "/admin/index", headers=ADMIN, timeout=5).json()
    return sum(w.get("redis_memory_blocks", 0) for w in stats["workers"].values())


def _admin_view(gw: Gateway) -> tuple[set[str], str]:
    workers = httpx.get(gw.url + "/admin/workers", headers=ADMIN, timeout=5).json()["workers"]
    policy = httpx.get(gw.url + "/admin/routing", headers=ADMIN, timeout=5).json()["policy"]
    return {w["id"] for w in workers}, str(policy)


def test_redis_crash_and_volume_loss(tmp_path: Path) -> None:
    _require_redis_server()
    data = tmp_path / "redis-data"
    data.mkdir()
    server = RedisProcess(password=PASSWORD, config_file=SHIPPED_CONF, data_dir=data)
    (tmp_path / "redis-password").write_text(PASSWORD + "\n")
    (tmp_path / "worker-token").write_text("cluster-token\n")
    closed = {"DGW_WORKER_TOKEN_FILE": str(tmp_path / "worker-token"),
              "DGW_REDIS__PASSWORD_FILE": str(tmp_path / "redis-password")}
    toml = (f'redis.url = "{server.url}"\napi_keys_in_redis = true\nadmin_worker_hosts = ["127.0.0.1"]\n'
            f'[[api_keys]]\nname = "admin"\nkey_sha256 = "{_digest(ADMIN_KEY)}"\nadmin = true\n')
    server.start()
    cluster = SimCluster("unified:sm100,unified:sm100", time_scale=20.0, env=closed)
    gateways: list[Gateway] = []
    admin = redis.Redis(port=server.port, password=PASSWORD)
    try:
        admin.hset(f"dgw:apikey:{_digest(CLIENT_KEY)}", mapping={"name": "client"})
        a = Gateway(tmp_path, [(cluster.urls[0], "unified", "sm100")], extra_toml=toml, env=closed)
        gateways.append(a)
        a.wait_ready(1)
        added = httpx.post(a.url + "/admin/workers", headers=ADMIN, json={"url": cluster.urls[1]}, timeout=10)
        assert added.status_code == 201, added.text
        assert httpx.put(a.url + "/admin/routing", headers=ADMIN, json={"policy": "round_robin"},
                         timeout=10).status_code == 200
        changed = _admin_view(a)
        assert len(changed[0]) == 2 and changed[1] == "round_robin"
        for i in range(6):
            assert _chat(a, CLIENT_KEY, f"conversation {i}: " + "a long shared system prompt " * 40).status_code == 200
        before = _until(lambda: _redis_blocks(a), REFILL_S, "the index reaching Redis")
        time.sleep(1.5)  # appendfsync everysec: what is older than a second is on disk

        # 1. SIGKILL, restart on the same data directory.
        server.stop()
        server.start()
        admin = redis.Redis(port=server.port, password=PASSWORD)
        assert admin.exists(f"dgw:apikey:{_digest(CLIENT_KEY)}") == 1
        assert admin.hlen(WORKERS_KEY) == 1
        b = Gateway(tmp_path, [(cluster.urls[0], "unified", "sm100")], extra_toml=toml, env=closed)
        gateways.append(b)  # a replica replaced: it starts from what Redis kept
        b.wait_ready(2)
        assert _admin_view(b) == changed
        assert _chat(b, CLIENT_KEY).status_code == 200  # a key seen for the first time here
        _until(lambda: _redis_blocks(a) >= before, REFILL_S, "the index refilled after the crash")

        # 2. SIGTERM (a drain, a reschedule): Redis writes its file before exiting; nothing is lost,
        #    not even what was written a moment before.
        admin.hset(f"dgw:apikey:{_digest('added-just-before')}", mapping={"name": "late"})
        assert server.proc is not None
        server.proc.terminate()
        server.proc.wait(timeout=30)
        server.stop()
        server.start()
        admin = redis.Redis(port=server.port, password=PASSWORD)
        assert admin.exists(f"dgw:apikey:{_digest('added-just-before')}") == 1

        # 3. The data directory lost: an empty Redis.
        server.stop()
        shutil.rmtree(data)
        data.mkdir()
        server.start()
        admin = redis.Redis(port=server.port, password=PASSWORD)
        _until(lambda: admin.hlen(WORKERS_KEY) == 1 and admin.exists(KEPT_KEY), 10,
               "the admin changes written back by a replica")
        assert _admin_view(a) == changed and _admin_view(b) == changed
        _until(lambda: _redis_blocks(a) >= before, REFILL_S, "the index refilled into an empty Redis")
        assert _chat(b, ADMIN_KEY).status_code == 200  # keys from the settings (the Secret) stay
        assert admin.exists(f"dgw:apikey:{_digest(CLIENT_KEY)}") == 0  # keys only in Redis went with it
    finally:
        admin.close()
        for gw in gateways:
            gw.stop()
        cluster.stop()
        server.stop()
