"""`create_prefix_index`: the one place that picks a prefix index backend.

In-memory when no Redis URL is configured (demo, one replica); Redis otherwise (any
number of replicas sharing `redis_url` + `namespace` agree on where prefixes are cached).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry

from deepinfer_gateway.kvcache.memory import InMemoryPrefixIndex
from deepinfer_gateway.kvcache.redis_index import RedisPrefixIndex
from deepinfer_gateway.kvcache.types import DEFAULT_STORE_TTL_S, KvIndexMetrics, PrefixIndex
from deepinfer_gateway.redis_conn import redis_client


def create_prefix_index(
    redis_url: str | None,
    *,
    redis_cluster: bool = False,
    redis_password: str | None = None,
    redis_password_file: str | None = None,
    namespace: str = "dgw:kv",
    registry: CollectorRegistry | None = None,
    max_blocks_per_worker: int = 1 << 20,
    max_store_blocks: int = 4_000_000,
    default_store_ttl_s: float = DEFAULT_STORE_TTL_S,
    redis_timeout_s: float = 0.5,
    writer_lease_s: float = 3.0,
    clock: Callable[[], float] = time.time,
) -> PrefixIndex:
    """In-memory index when `redis_url` is None, else the Redis index (with a local view).

    Gateway replicas that should agree on routing pass the same `redis_url` and
    `namespace`; `redis_cluster` when `redis_url` names a node of a Redis Cluster.
    `writer_lease_s`: how long the replica that writes a worker's events to Redis keeps
    that role, renewed by each write (0: every replica writes). Call `aclose()` on shutdown.
    """
    if redis_url is None:
        return InMemoryPrefixIndex(
            max_blocks_per_worker=max_blocks_per_worker,
            max_store_blocks=max_store_blocks,
            default_store_ttl_s=default_store_ttl_s,
            clock=clock,
        )
    return RedisPrefixIndex(
        redis_client(redis_url, cluster=redis_cluster, timeout_s=redis_timeout_s, password=redis_password,
                     password_file=redis_password_file),
        namespace=namespace,
        metrics=KvIndexMetrics(registry),
        max_blocks_per_worker=max_blocks_per_worker,
        max_store_blocks=max_store_blocks,
        default_store_ttl_s=default_store_ttl_s,
        writer_lease_s=writer_lease_s,
        clock=clock,
    )
