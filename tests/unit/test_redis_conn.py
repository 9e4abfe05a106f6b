"""redis_client's password sources: a URL's credentials give way to a password file, which is
read at each new connection."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from deepinfer_gateway.infra.redis_conn import PasswordFile, _without_credentials, redis_client


def test_url_credentials_are_dropped_for_a_password_file() -> None:
    assert _without_credentials("redis://:old@redis:6379/0") == "redis://redis:6379/0"
    assert _without_credentials("rediss://user:pw@h:6380/1?ssl_ca_certs=/ca.pem") == "rediss://h:6380/1?ssl_ca_certs=/ca.pem"
    assert _without_credentials("redis://redis:6379/0") == "redis://redis:6379/0"


def test_the_password_file_is_read_each_time(tmp_path: Path) -> None:
    path = tmp_path / "password"
    path.write_text("# rotated\nfirst\n")
    provider = PasswordFile(str(path))
    assert provider.get_credentials() == ("first",)
    path.write_text("second\n")
    assert asyncio.run(provider.get_credentials_async()) == ("second",)
    path.write_text("\n")
    with pytest.raises(RedisConnectionError, match="empty"):
        provider.get_credentials()
    path.unlink()
    with pytest.raises(RedisConnectionError, match="cannot read"):
        provider.get_credentials()


def test_a_client_takes_the_file_over_the_urls_password(tmp_path: Path) -> None:
    (tmp_path / "password").write_text("from-file\n")
    client = redis_client("redis://:from-url@127.0.0.1:6379/0", password_file=str(tmp_path / "password"))
    kwargs = client.connection_pool.connection_kwargs
    assert kwargs.get("password") is None and isinstance(kwargs["credential_provider"], PasswordFile)
    plain = redis_client("redis://127.0.0.1:6379/0", password="given")
    assert plain.connection_pool.connection_kwargs["password"] == "given"
