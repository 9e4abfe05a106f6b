"""The routing core both front ends compose: `serve`'s app lifespan (app.py) and the EPP
(epp/runtime.py), built once from the settings.

`RoutingCore.start` builds, in this order: the worker upstreams (health probes, KV event
sources, the request legs; worker protocol v2 where `worker_protocol` allows it), the Redis
client, the prefix index and its KV event feeder, the in-flight reservations, the worker
registry with its health checks, the planner, the admin sync (the shared admin changes,
before the first request) and DNS discovery (the workers its names have now, before the
first request). `stop` tears them down in reverse, the in-flight releases flushed to Redis
before its client closes. What a front end adds (the request server, API keys and rate
limits; the ext_proc and health servers) it builds on these parts.
"""

from __future__ import annotations

import asyncio
import time

from redis import asyncio as aioredis

from deepinfer_gateway.config import GatewaySettings
from deepinfer_gateway.core.worker_auth import tokens_from
from deepinfer_gateway.gateway.fleet.admin_store import AdminStore
from deepinfer_gateway.gateway.fleet.admin_sync import AdminSync
from deepinfer_gateway.gateway.fleet.discovery import WorkerDiscovery
from deepinfer_gateway.gateway.fleet.registry import WorkerRegistry
from deepinfer_gateway.gateway.fleet.worker_allow import WorkerAllowList
from deepinfer_gateway.gateway.serving.shared_affinity import SharedAffinity
from deepinfer_gateway.gateway.telemetry.metrics import GatewayMetrics
from deepinfer_gateway.gateway.upstream.base import Timeouts
from deepinfer_gateway.gateway.upstream.table import Upstreams
from deepinfer_gateway.infra.redis_conn import redis_client_for
from deepinfer_gateway.kvcache.events import KvEventFeeder
from deepinfer_gateway.kvcache.factory import create_prefix_index
from deepinfer_gateway.kvcache.types import PrefixIndex
from deepinfer_gateway.recipe_bridge.tokenizer import TokenizerBundle
from deepinfer_gateway.router.inflight import MemoryInflight, RedisInflight
from deepinfer_gateway.router.planner import RoutePlanner

LEGS_END_S = 2.0  # at shutdown, the longest the cancelled requests get to end their legs


class RoutingCore:
    """The parts of routing a front end shares (module doc); each attribute is set by `start`."""

    client: Upstreams
    redis: aioredis.Redis | None
    index: PrefixIndex
    feeder: KvEventFeeder
    inflight: MemoryInflight | RedisInflight
    affinity: SharedAffinity | None  # sessions' workers, shared by the replicas (Redis, affinity on)
    registry: WorkerRegistry
    planner: RoutePlanner
    admin: AdminSync
    discovery: WorkerDiscovery

    def __init__(self, settings: GatewaySettings, bundle: TokenizerBundle, metrics: GatewayMetrics):
        self.settings = settings
        self.bundle = bundle
        self.metrics = metrics

    async def start(self) -> None:
        settings, metrics = self.settings, self.metrics
        self.client = client = Upstreams(
            self.bundle, Timeouts(connect_s=settings.connect_timeout_s, first_event_s=settings.first_event_timeout_s,
                                  between_events_s=settings.between_events_timeout_s),
            tokens=tokens_from(settings.worker_token, settings.worker_token_file),
            mux=settings.worker_protocol == "auto", mux_metrics=metrics)
        await client.start()
        self.redis = redis = redis_client_for(settings.redis) if settings.redis.url else None
        self.index = index = create_prefix_index(settings.redis, registry=metrics.registry,
                                                 writer_lease_s=settings.kv_writer_lease_s)
        self.feeder = feeder = KvEventFeeder(index, client.session, interval_s=settings.router.kv_events_interval_s)
        self.inflight = (RedisInflight(redis, settings.router.inflight_lease_s,
                                       metrics.redis_errors.labels("inflight").inc)
                         if redis else MemoryInflight())
        affinity = settings.router.session_affinity
        self.affinity = (SharedAffinity(redis, affinity.ttl_s, metrics.redis_errors.labels("affinity").inc)
                         if redis and affinity.enabled else None)
        self.registry = registry = WorkerRegistry(settings.workers, client, settings.health, metrics)
        for worker in registry.workers.values():
            feeder.add(worker.worker_id, worker.upstream.kv_source())
        await registry.start()
        self.planner = RoutePlanner(settings.router)
        self.admin = admin = AdminSync(AdminStore(redis) if redis else None, registry, feeder, self.planner,
                                       settings.workers, metrics.redis_errors.labels("admin").inc,
                                       allow=WorkerAllowList.build(settings.admin_worker_hosts, settings.workers))
        await admin.start()  # with Redis: the shared admin changes, before the first request
        self.discovery = WorkerDiscovery(settings.discovery, client, registry, admin.set_discovered)
        await self.discovery.start()  # the workers DNS names now, before the first request

    async def stop(self) -> None:
        await self._legs_ended()
        await self.discovery.stop()
        await self.admin.stop()
        await self.registry.stop()
        await self.feeder.aclose()
        await self.index.aclose()
        await self.client.close()
        await self.inflight.flush()  # the drained requests' releases reach Redis, not their lease expiry
        if self.redis is not None:
            await self.redis.aclose()

    async def _legs_ended(self, timeout_s: float = LEGS_END_S) -> None:
        """Up to `timeout_s` for the legs still open to end. The server cancels the requests the
        grace period left and goes on to shut the app down without waiting for them: a leg's
        release is queued only when its task runs its cancellation, and it must be queued before
        the flush that sends it."""
        deadline = time.monotonic() + timeout_s
        workers = self.registry.workers
        while any(w.inflight for w in workers.values()) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
