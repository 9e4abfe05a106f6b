"""`redis_client`: the one way the gateway connects to Redis (or a Redis Cluster).

Every Redis user (prefix index, rate limiter, in-flight reservations, API keys) keeps
its keys under one hash tag per structure, so each script or transaction touches one
slot and runs unchanged on Redis Cluster; `cluster=True` only swaps in redis-py's
cluster client, which routes each command to the node owning its slot.

Clients fail fast (no retries, short timeouts): every caller has its own fallback for a
Redis outage and must not stall a request on reconnects.

`url` may be `redis://`, `rediss://` or `unix:///path/redis.sock` (the server that
`serve --processes N` starts for its own processes, supervisor.py).
"""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import Connection, UnixDomainSocketConnection
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.connection import HiredisRespSerializer
from redis.utils import HIREDIS_AVAILABLE


class _HiredisPacking:
    """Packs commands with hiredis (C), as redis-py's sync client does; its asyncio client
    packs in Python, which costs more than the prefix lookup's Redis-side work for 64 keys."""

    _packer = HiredisRespSerializer()

    def pack_command(self, *args: Any) -> list[bytes]:
        return self._packer.pack(*args)


class HiredisPackingConnection(_HiredisPacking, Connection):
    """TCP (redis://)."""


class HiredisPackingUnixConnection(_HiredisPacking, UnixDomainSocketConnection):
    """Unix socket (unix://)."""


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


def redis_client(
    url: str, *, cluster: bool = False, timeout_s: float = 0.5, max_connections: int = 256, **kwargs: Any
) -> aioredis.Redis:
    """A fail-fast client for `url`; with `cluster`, `url` names any node of a Redis Cluster.

    Past `max_connections` busy connections, a caller waits up to `timeout_s` for one (a
    plain pool would raise at once, turning a burst of requests into a fake outage).
    """
    if HIREDIS_AVAILABLE:
        kwargs.setdefault("connection_class", HiredisPackingConnection)
    options: dict[str, Any] = dict(
        socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0),
        max_connections=max_connections, **kwargs,
    )
    if cluster:
        # The cluster client has the Redis command API the callers use; typed as Redis for them.
        return _Cluster.from_url(url, **options)  # type: ignore[return-value]
    pool = aioredis.BlockingConnectionPool.from_url(url, timeout=timeout_s, **options)
    if HIREDIS_AVAILABLE and issubclass(pool.connection_class, UnixDomainSocketConnection):
        # from_url lets a unix:// URL's own connection class win over the one passed in.
        pool.connection_class = HiredisPackingUnixConnection
    return aioredis.Redis(connection_pool=pool)
