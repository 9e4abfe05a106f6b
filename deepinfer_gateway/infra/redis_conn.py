"""`redis_client`: the one way the gateway connects to Redis (or a Redis Cluster).

Every Redis user (prefix index, rate limiter, in-flight reservations, API keys) keeps
its keys under one hash tag per structure, so each script or transaction touches one
slot and runs unchanged on Redis Cluster; `cluster=True` only swaps in redis-py's
cluster client, which routes each command to the node owning its slot.

Clients fail fast (short timeouts, no retry after a timeout): every caller has its own
fallback for a Redis outage and must not stall a request on reconnects. A connection error
is retried once, at once, on a fresh connection: after Redis restarts, every idle pooled
connection is dead, and its first use fails ("Connection closed by server") although Redis
is back; without the retry each such connection cost a failed call and, with the outage
breaker (outage.py), another second of fallback.

`url` may be `redis://`, `rediss://` (TLS; `?ssl_ca_certs=/path/ca.pem` names the CA) or
`unix:///path/redis.sock` (the server that `serve --processes N` starts for its own
processes, supervisor.py). The password comes from the URL, `password`, or `password_file`
(a mounted Secret), which is re-read at each new connection: after a rotation, connections
opened from then on use the new password while open ones keep theirs. The URL's user
(`redis://gateway@redis:6379/0`) is the ACL user the password belongs to, whichever of the
three gives it; without one it is Redis's `default` user.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit, urlunsplit

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import AbstractConnection, Connection, SSLConnection, UnixDomainSocketConnection
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.connection import HiredisRespSerializer
from redis.credentials import CredentialProvider
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.utils import HIREDIS_AVAILABLE

if TYPE_CHECKING:
    from deepinfer_gateway.config import RedisSettings

# asyncio.wait_for drops a cancellation that lands as the awaited call completes, before 3.12.
_WAIT_FOR_DROPS_CANCELS = sys.version_info < (3, 12)


class _GatewayConnection(AbstractConnection):
    """redis-py's connection with two changes:
    - commands are packed with hiredis (C) where it is installed, as redis-py's sync client
      does; its asyncio client packs in Python, which costs more than the prefix lookup's
      Redis-side work for 64 keys;
    - a command is sent under `asyncio.timeout`, not redis-py's `asyncio.wait_for`, which on
      Python < 3.12 returns the send's result and drops a cancellation that lands as the send
      completes (CPython gh-86296). A task cancelled in a Redis call then carried on: about
      half the cancels of a task looping on a command were lost, and a background loop that
      ignores its cancel never ends (a gateway stopping waited for it forever)."""

    _packer = HiredisRespSerializer() if HIREDIS_AVAILABLE else None

    def pack_command(self, *args: Any) -> list[bytes]:
        return self._packer.pack(*args) if self._packer is not None else super().pack_command(*args)

    async def send_packed_command(self, command: bytes | str | Iterable[bytes], check_health: bool = True) -> None:
        timeout = self.socket_timeout
        if timeout is None or not _WAIT_FOR_DROPS_CANCELS:
            return await super().send_packed_command(command, check_health)
        try:
            async with asyncio.timeout(timeout):
                self.socket_timeout = None  # the parent then writes directly, without wait_for
                try:
                    await super().send_packed_command(command, check_health)
                finally:
                    self.socket_timeout = timeout
        except TimeoutError:  # ours; the parent's own timeouts are redis-py's TimeoutError already
            await self.disconnect(nowait=True)
            raise RedisTimeoutError("Timeout writing to socket") from None


class GatewayTcpConnection(_GatewayConnection, Connection):
    """TCP (redis://)."""


class GatewayUnixConnection(_GatewayConnection, UnixDomainSocketConnection):
    """Unix socket (unix://)."""


class GatewaySslConnection(_GatewayConnection, SSLConnection):
    """TLS (rediss://)."""


# from_url picks the class from the URL's scheme, over the one passed in: swapped afterwards.
_GATEWAY_CLASS = {UnixDomainSocketConnection: GatewayUnixConnection, SSLConnection: GatewaySslConnection,
                  Connection: GatewayTcpConnection}


_READ_ONLY_SCRIPTS = ("EVALSHA_RO", "EVAL_RO")


class _Cluster(RedisCluster):
    """redis-py's cluster client, with two fixes:
    - initialized before a first command runs: when many tasks start on a fresh client at
      once (measured with redis 8.1), commands routed before the node discovery finished
      fail with "Connection closed by server";
    - read-only scripts go straight to their key's node: redis-py reads EVAL/EVALSHA keys
      itself but asks a node for EVALSHA_RO's (COMMAND GETKEYS: a second round trip per
      lookup, carrying every argument, and a failure point under load)."""

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        if self._initialize:
            await self.initialize()  # locked inside: one discovery, the others wait for it
        if str(args[0]).upper() in _READ_ONLY_SCRIPTS and "target_nodes" not in kwargs and int(args[2]) > 0:
            kwargs["target_nodes"] = self.get_node_from_key(args[3])  # args: command, script, numkeys, key...
        return await super().execute_command(*args, **kwargs)


class PasswordFile(CredentialProvider):
    """The Redis password as the first non-blank line of a file, read at each new connection;
    with `username`, that ACL user's (AUTH username password), else the `default` user's."""

    def __init__(self, path: str, username: str | None = None):
        self.path = path
        self.username = username

    def get_credentials(self) -> tuple[str] | tuple[str, str]:
        from deepinfer_gateway.core.worker_auth import parse_tokens

        try:
            found = parse_tokens(Path(self.path).read_text())
        except OSError as e:
            raise RedisConnectionError(f"cannot read the Redis password file {self.path}: {e.strerror}") from None
        if not found:
            raise RedisConnectionError(f"the Redis password file {self.path} is empty")
        return (self.username, found[0]) if self.username else (found[0],)

    async def get_credentials_async(self) -> tuple[str] | tuple[str, str]:
        return self.get_credentials()


def redis_client(
    url: str, *, cluster: bool = False, timeout_s: float = 0.5, max_connections: int = 256,
    password: str | None = None, password_file: str | None = None, **kwargs: Any
) -> aioredis.Redis:
    """A fail-fast client for `url`; with `cluster`, `url` names any node of a Redis Cluster.
    `password` or `password_file` (re-read per connection) override the URL's password.

    Past `max_connections` busy connections, a caller waits up to `timeout_s` for one (a
    plain pool would raise at once, turning a burst of requests into a fake outage).
    """
    if password_file:
        kwargs["credential_provider"] = PasswordFile(password_file, _username(url))
        url = _without_credentials(url)  # redis-py refuses URL credentials beside a credential provider
    elif password:
        kwargs["password"] = password
    kwargs.setdefault("connection_class", GatewayTcpConnection)
    options: dict[str, Any] = dict(
        socket_timeout=timeout_s, socket_connect_timeout=timeout_s, max_connections=max_connections,
        retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
        # No CLIENT SETINFO on connect: the shipped ACL user (deploy/k8s/redis.yaml) is allowed
        # only the commands the gateway needs, and a refused one would fill Redis's ACL LOG.
        driver_info=None, **kwargs,
    )
    if cluster:
        # The cluster client has the Redis command API the callers use; typed as Redis for them.
        return _Cluster.from_url(url, **options)  # type: ignore[return-value]
    pool = aioredis.BlockingConnectionPool.from_url(url, timeout=timeout_s, **options)
    pool.connection_class = _GATEWAY_CLASS.get(pool.connection_class, pool.connection_class)
    return aioredis.Redis(connection_pool=pool)


def redis_client_for(settings: RedisSettings, **kwargs: Any) -> aioredis.Redis:
    """A client for the `[redis]` settings (their url set)."""
    if not settings.url:
        raise ValueError("redis.url is not set")
    return redis_client(settings.url, cluster=settings.cluster, timeout_s=settings.timeout_s,
                        password=settings.password, password_file=settings.password_file, **kwargs)


def _username(url: str) -> str | None:
    """The URL's user (percent-decoded), None without one."""
    return unquote(user) if (user := urlsplit(url).username) else None


def _without_credentials(url: str) -> str:
    """`url` without its user and password part (the password file's provider carries the user)."""
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))
