"""Workers of an InferencePool: a `[[discovery]]` entry of kind "kubernetes" names the pool; its
selector's ready pods, at each of its targetPorts, are the workers (kube_pool.py says which pod
counts). `KubernetesLookup` is a discovery.py `Resolver`, so a pod that leaves is drained and a
new one probed exactly as a DNS address would be; both `serve` and `epp` follow it.

How it reads the API server (kube_api.py), as an informer does:
- The pool: GET it, then watch it (fieldSelector metadata.name) from its resourceVersion; a
  change of its selector or ports restarts the pods' follower with the new ones; the pool
  deleted (or not there yet) is an empty pool, and its creation is waited for by a watch
  from no version (which begins with the objects that exist: no list right needed).
- The pods: list by the selector, then watch from the list's resourceVersion, each event
  applied to the set (`PodSet`); a watch the server ends is resumed from the last
  resourceVersion seen (bookmarks keep it recent); 410 Gone lists again.
- Failures (the server unreachable, 5xx, a refused token) back off exponentially and retry;
  the last endpoints stay meanwhile, so an API server outage never empties a pool. Until the
  first list answers, `resolve` raises LookupFailed (no answer, not zero workers).
RBAC: get and watch on the pool's inferencepools, get, list and watch on pods (deploy/k8s/epp).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from urllib.parse import quote

from deepinfer_gateway.config import DiscoverySpec
from deepinfer_gateway.gateway.fleet.endpoints import Endpoint, LookupFailed
from deepinfer_gateway.gateway.fleet.kube_api import ApiAccess, ApiError, Backoff, Expired, KubeApi, NotFound
from deepinfer_gateway.gateway.fleet.kube_pool import (
    BadObject,
    PodSet,
    PoolSpec,
    WatchEvent,
    pool_spec,
    resource_version,
)

log = logging.getLogger(__name__)

FIRST_SYNC_S = 5.0  # the first resolve waits this long for the first list before it reports no answer
POOLS = "/apis/inference.networking.k8s.io/v1/namespaces/{namespace}/inferencepools"
PODS = "/api/v1/namespaces/{namespace}/pods"


class KubernetesLookup:
    def __init__(self, found: DiscoverySpec, api: KubeApi | None = None, backoff: Backoff | None = None):
        self._found = found
        self._api = api or KubeApi(ApiAccess.of(found))
        namespace = quote(self._api.access.namespace, safe="")
        self._pools = POOLS.format(namespace=namespace)
        self._pool = f"{self._pools}/{quote(found.name, safe='')}"
        self._pods = PODS.format(namespace=namespace)
        self._backoff = backoff or Backoff()
        self._endpoints: set[Endpoint] | None = None  # None until the first answer
        self._synced = asyncio.Event()
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._failing = False

    @property
    def where(self) -> str:
        return f"InferencePool {self._api.access.namespace}/{self._found.name}"

    async def resolve(self) -> set[Endpoint]:
        if self._task is None:
            self._task = asyncio.create_task(self._follow_pool(), name=f"kubernetes:{self._found.name}")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._synced.wait(), FIRST_SYNC_S)
        self._changed.clear()
        if self._endpoints is None:
            raise LookupFailed(f"{self.where}: no answer from the API server yet")
        return set(self._endpoints)

    async def changed(self, timeout_s: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), timeout_s)

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await self._api.aclose()

    def _publish(self, endpoints: set[Endpoint]) -> None:
        if endpoints != self._endpoints:
            self._endpoints = endpoints
            self._changed.set()
        self._synced.set()

    async def _retry_after(self, exc: Exception) -> None:
        if not self._failing:
            log.warning("discovery: %s: %s; keeping its %d endpoints, retrying", self.where, exc,
                        len(self._endpoints or ()))
        self._failing = True
        await asyncio.sleep(self._backoff.next())

    def _recovered(self) -> None:
        if self._failing:
            log.info("discovery: %s answers again", self.where)
        self._failing = False
        self._backoff.reset()

    async def _follow_pool(self) -> None:
        """The pool object, and under it the follower of its pods, for as long as it runs."""
        while True:
            try:
                spec: PoolSpec | None
                version: str | None
                try:
                    pool = await self._api.get(self._pool)
                except NotFound:  # a watch from no version starts with the pool's ADDED once it exists
                    spec, version = None, None
                else:
                    spec, version = pool_spec(pool), resource_version(pool)
                self._recovered()
                if spec is None:
                    log.warning("discovery: %s does not exist (yet): no workers", self.where)
                    self._publish(set())
                pods = asyncio.create_task(self._follow_pods(spec)) if spec else None
                try:
                    await self._until_pool_changes(spec, version)
                finally:
                    if pods is not None:
                        pods.cancel()
                        with contextlib.suppress(asyncio.CancelledError):
                            await pods
            except Expired as exc:
                log.info("discovery: %s: %s; reading the pool again", self.where, exc)
            except (ApiError, BadObject) as exc:
                await self._retry_after(exc)

    async def _until_pool_changes(self, spec: PoolSpec | None, version: str | None) -> None:
        """Returns when the pool's selector or ports differ from `spec` (None: no pool)."""
        params = {"fieldSelector": f"metadata.name={self._found.name}"}
        while True:
            since = {} if version is None else {"resourceVersion": version}
            try:
                async for event in self._api.watch(self._pools, {**params, **since}):
                    version = resource_version(event.object)
                    if self._pool_changed(event, spec):
                        return
            except Expired:
                # The pool's own version ages while it does not change, and the server keeps a
                # window of history only: watch from now, which begins with the pool as it is.
                if version is None:  # even that refused: a server to be patient with
                    await asyncio.sleep(self._backoff.next())
                version = None

    def _pool_changed(self, event: WatchEvent, spec: PoolSpec | None) -> bool:
        """Whether this event of the pool's watch ends the current pool (changed or deleted)."""
        if event.type == "DELETED" and spec is not None:
            log.warning("discovery: %s deleted: no workers", self.where)
            self._publish(set())
            return True
        if event.type in ("ADDED", "MODIFIED") and pool_spec(event.object) != spec:
            changed = pool_spec(event.object)
            log.info("discovery: %s now selects %s on ports %s", self.where, changed.label_selector, changed.ports)
            return True
        return False

    async def _follow_pods(self, spec: PoolSpec) -> None:
        """List the pool's pods, then watch them; list again on 410, back off on failures."""
        pods = PodSet(spec.ports)
        selector = {"labelSelector": spec.label_selector}
        while True:
            try:
                listing = await self._api.get(self._pods, selector)
                version = resource_version(listing)
                pods.replace(listing.get("items") or [])
                self._recovered()
                self._publish(pods.endpoints())
                while True:  # each watch runs until the server ends it; resume from the last version seen
                    async for event in self._api.watch(self._pods, {**selector, "resourceVersion": version}):
                        version = resource_version(event.object)
                        if event.type != "BOOKMARK":
                            pods.apply(event)
                            self._publish(pods.endpoints())
            except Expired as exc:
                log.info("discovery: %s: %s; listing its pods again", self.where, exc)
            except (ApiError, BadObject) as exc:
                await self._retry_after(exc)
