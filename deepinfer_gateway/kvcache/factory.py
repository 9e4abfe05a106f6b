"""`create_prefix_index`: the one place that picks a prefix index backend.

In-memory when no Redis URL is configured (demo, one replica); Redis otherwise (any
number of replicas sharing `redis.url` + `namespace` agree on where prefixes are cached).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry

from deepinfer_gateway.infra.redis_conn import redis_client_for
from deepinfer_gateway.kvcache.memory import InMemoryPrefixIndex
from deepinfer_gateway.kvcache.redis_index import RedisPrefixIndex
from deepinfer_gateway.kvcache.types import DEFAULT_STORE_TTL_S, KvIndexMetrics, PrefixIndex

if TYPE_CHECKING:
    from deepinfer_gateway.config import RedisSettings


def create_prefix_index(
    redis: RedisSettings | None,
    *,
    namespace: str = "dgw:kv",
    registry: CollectorRegistry | None = None,
    max_blocks_per_worker: int = 1 << 20,
    max_store_blocks: int = 4_000_000,
    default_store_ttl_s: float = DEFAULT_STORE_TTL_S,
    writer_lease_s: float = 3.0,
    clock: Callable[[], float] = time.time,
) -> PrefixIndex:
    """In-memory index without `redis` or its url, else the Redis index (with a local view).

    Gateway replicas that should agree on routing pass the same `redis.url` and
    `namespace` (`redis.cluster` when the url names a node of a Redis Cluster).
    `writer_lease_s`: how long the replica that writes a worker's events to Redis keeps
    that role, renewed by each write (0: every replica writes). Call `aclose()` on shutdown.
    """
    if redis is None or not redis.url:
        return InMemoryPrefixIndex(
            max_blocks_per_worker=max_blocks_per_worker,
            max_store_blocks=max_store_blocks,
            default_store_ttl_s=default_store_ttl_s,
            clock=clock,
        )
    return RedisPrefixIndex(
        redis_client_for(redis),
        namespace=namespace,
        metrics=KvIndexMetrics(registry),
        max_blocks_per_worker=max_blocks_per_worker,
        max_store_blocks=max_store_blocks,
        default_store_ttl_s=default_store_ttl_s,
        writer_lease_s=writer_lease_s,
        clock=clock,
    )
