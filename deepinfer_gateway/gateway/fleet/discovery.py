"""Workers found by DNS: each `[[discovery]]` name (a headless Service, a compose service) is
re-resolved every `interval_s`, so scaling a pool is one change, its replica count. An entry of
kind "kubernetes" follows an InferencePool's ready pods instead (kube_discovery.py, a watch
through the API server that wakes the loop at each change); everything below holds for both.

- A new address is probed at `/v1/worker/info` through the gateway's upstream pool (`HttpPool`, upstream/http.py, with
  whatever credentials it sends) for its role and hardware (a vLLM or OpenAI pool takes
  them from the config, its health checks probe `/v1/models`); a probe that fails is retried
  at the next resolution, so a pod that is not serving yet joins once it does.
- A vanished address is drained: it takes no new request at once (`WorkerRegistry.drain`),
  its requests in flight get `drain_timeout_s` to finish, then it is removed, which takes it
  out of the registry, the prefix index (the KV event feeder forgets it) and the metrics.
  An address that comes back while draining is simply taken back.
- A lookup that fails (timeout, SERVFAIL, no nameserver) changes nothing: only an answer
  (NXDOMAIN or no records: zero workers) removes workers, so a DNS outage never empties a pool.

The worker set found is handed to `AdminSync.set_discovered`, which applies it with the
configured `[[workers]]` and the admin API's changes (admin_store.desired_workers): a worker
is added and removed on one path whichever source names it. Each gateway replica (and each
process of `serve --processes`) resolves on its own; DNS is the state they share.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import dns.asyncresolver
import dns.exception
import dns.nameserver
import dns.resolver

from deepinfer_gateway.config import DiscoverySpec, WorkerEngine, WorkerSpec, parse_worker_spec
from deepinfer_gateway.core import protocol as wp
from deepinfer_gateway.core.errors import UpstreamError
from deepinfer_gateway.gateway.fleet.endpoints import Endpoint, LookupFailed, Resolver
from deepinfer_gateway.gateway.fleet.kube_discovery import KubernetesLookup
from deepinfer_gateway.gateway.fleet.registry import WorkerRegistry
from deepinfer_gateway.gateway.upstream.http import HttpPool

log = logging.getLogger(__name__)

LOOKUP_TIMEOUT_S = 3.0  # one resolution, all nameservers and retries included
_DRAIN_POLL_S = 0.05


def worker_spec(found: DiscoverySpec, endpoint: Endpoint, info: wp.WorkerInfo | None) -> WorkerSpec:
    """The spec of a worker found at `endpoint`: the discovery entry's overrides, else what the
    worker reported (`info`, None for vllm/openai pools, whose entry names role and hardware)."""
    role = found.role or (info.role if info else wp.Role.UNIFIED)
    hardware = found.hardware or (info.hardware if info else None)
    assert hardware is not None, "DiscoverySpec requires hardware for pools that report none"
    kv_events = Endpoint(endpoint.host, found.kv_events_port).url("tcp") if found.kv_events_port else ""
    # Keys an engine's variant has not are dropped when empty (config_models._engine_or_dgw).
    return parse_worker_spec({"url": endpoint.url(found.scheme), "engine": found.engine, "model": found.model,
                              "role": role, "hardware": hardware, "pool": found.pool, "kv_events_endpoint": kv_events})


def nameserver(address: str) -> dns.nameserver.Do53Nameserver:
    """'IP' or 'IP:PORT' (an IPv6 address alone has no port: '::1')."""
    if address.count(":") == 1:
        host, port = address.split(":")
        return dns.nameserver.Do53Nameserver(host, int(port))
    return dns.nameserver.Do53Nameserver(address)


class DnsLookup:
    """The endpoints a discovery entry's name resolves to, with dnspython's asyncio resolver."""

    def __init__(self, found: DiscoverySpec):
        self._found = found
        self._resolver = dns.asyncresolver.Resolver(configure=not found.nameservers)
        if found.nameservers:
            self._resolver.nameservers = [nameserver(a) for a in found.nameservers]
        self._resolver.lifetime = LOOKUP_TIMEOUT_S
        self._resolver.cache = None  # every round asks: the point is to see changes

    async def resolve(self) -> set[Endpoint]:
        """Raises LookupFailed when no answer came (an empty answer is an empty set)."""
        if self._found.srv:
            targets = await self._records(self._found.name, "SRV")
            out: set[Endpoint] = set()
            for record in targets:
                hosts = await self._addresses(record.target.to_text())
                out |= {Endpoint(host, record.port) for host in hosts}
            return out
        return {Endpoint(host, self._found.port) for host in await self._addresses(self._found.name)}

    async def _addresses(self, name: str) -> set[str]:
        v4, v6 = await asyncio.gather(self._records(name, "A"), self._records(name, "AAAA"))
        return {str(ipaddress.ip_address(r.address)) for r in (*v4, *v6)}

    async def _records(self, name: str, rdtype: str) -> list[Any]:
        """The answer's records (rdata of `rdtype`: .address for A/AAAA, .target and .port for SRV)."""
        try:
            answer = await self._resolver.resolve(name, rdtype, search=True)
        except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
            return []
        except (dns.exception.Timeout, dns.resolver.NoNameservers, dns.resolver.YXDOMAIN, OSError) as exc:
            raise LookupFailed(f"{name} {rdtype}: {exc}") from None
        return list(answer)

    async def changed(self, timeout_s: float) -> None:
        await asyncio.sleep(timeout_s)  # DNS tells no one: the name is asked again each interval

    async def aclose(self) -> None:
        pass


def lookup_for(found: DiscoverySpec) -> Resolver:
    """The source an entry names: its DNS name, or its InferencePool through the API server."""
    return KubernetesLookup(found) if found.kind == "kubernetes" else DnsLookup(found)


Lookup = Callable[[DiscoverySpec], Resolver]
ApplyDiscovered = Callable[[Mapping[str, WorkerSpec]], Awaitable[None]]


@dataclass
class _Followed:
    """One discovery entry's state: the workers it found, by endpoint, and those draining."""

    found: DiscoverySpec
    lookup: Resolver
    workers: dict[Endpoint, WorkerSpec] = field(default_factory=dict)
    draining: dict[Endpoint, asyncio.Task[None]] = field(default_factory=dict)
    failing: bool = False  # the last lookup failed (logged once per outage)


class WorkerDiscovery:
    def __init__(self, entries: tuple[DiscoverySpec, ...], client: HttpPool, registry: WorkerRegistry,
                 apply: ApplyDiscovered, lookup: Lookup = lookup_for):
        self._client = client
        self._registry = registry
        self._apply = apply
        self._followed = [_Followed(found, lookup(found)) for found in entries]
        self._tasks: list[asyncio.Task[None]] = []
        self._lock = asyncio.Lock()  # one apply at a time, in the order of the changes

    def discovered(self) -> dict[str, WorkerSpec]:
        """Every worker found and not yet removed (draining ones included), by worker id; the
        first entry to find an id keeps it."""
        out: dict[str, WorkerSpec] = {}
        for followed in self._followed:
            for spec in followed.workers.values():
                out.setdefault(spec.worker_id, spec)
        return out

    async def start(self) -> None:
        """One round of every entry (the workers up now serve from the first request), then loops."""
        await asyncio.gather(*(self.refresh(f) for f in self._followed))
        self._tasks = [asyncio.create_task(self._loop(f), name=f"discovery:{f.found.name}") for f in self._followed]

    async def stop(self) -> None:
        tasks = self._tasks + [t for f in self._followed for t in f.draining.values()]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        for followed in self._followed:
            await followed.lookup.aclose()

    async def _loop(self, followed: _Followed) -> None:
        while True:
            await followed.lookup.changed(followed.found.interval_s)
            try:
                await self.refresh(followed)
            except Exception:  # a bug must not end discovery for good
                log.exception("discovery of %s failed this round", followed.found.name)

    async def refresh(self, followed: _Followed) -> None:
        """Resolve the entry's name once and apply what changed."""
        name = followed.found.name
        try:
            resolved = await followed.lookup.resolve()
        except LookupFailed as exc:
            if not followed.failing:
                log.warning("discovery: cannot resolve %s, keeping its %d workers: %s", name,
                            len(followed.workers), exc)
            followed.failing = True
            return
        if followed.failing:
            log.info("discovery: %s resolves again", name)
        followed.failing = False
        for endpoint in resolved & followed.draining.keys():  # back before its drain ended
            followed.draining.pop(endpoint).cancel()
            state = self._registry.workers.get(followed.workers[endpoint].worker_id)
            if state is not None and state.spec == followed.workers[endpoint]:
                self._registry.drain(state.worker_id, draining=False)
            log.info("discovery: %s is back in %s, no longer draining", endpoint, name)
        new = [e for e in sorted(resolved) if e not in followed.workers]
        specs = await asyncio.gather(*(self._probe(followed.found, e) for e in new))
        added = {e: s for e, s in zip(new, specs, strict=True) if s is not None}
        for endpoint in followed.workers.keys() - resolved - followed.draining.keys():
            followed.draining[endpoint] = asyncio.create_task(self._drain(followed, endpoint),
                                                              name=f"drain:{endpoint.host}:{endpoint.port}")
        if added:
            followed.workers.update(added)
            for spec in added.values():
                log.info("discovery: worker %s found in %s (%s, %s)", spec.worker_id, name, spec.role, spec.hardware)
            await self._publish()

    async def _probe(self, found: DiscoverySpec, endpoint: Endpoint) -> WorkerSpec | None:
        if found.engine is not WorkerEngine.DGW:
            return worker_spec(found, endpoint, None)
        url = endpoint.url(found.scheme)
        try:
            info = wp.WorkerInfo.model_validate(await self._client.get_json(url, wp.INFO_PATH))
        except (UpstreamError, ValueError) as exc:
            log.info("discovery: %s not added yet (probe failed, retried next round): %s", url, exc)
            return None
        return worker_spec(found, endpoint, info)

    async def _drain(self, followed: _Followed, endpoint: Endpoint) -> None:
        spec = followed.workers[endpoint]
        worker_id = spec.worker_id
        state = self._registry.workers.get(worker_id)
        if state is not None and state.spec != spec:
            state = None  # the id is served from the config or the admin API: not this entry's to drain
        if state is not None:
            self._registry.drain(worker_id)
            log.info("discovery: %s left %s, draining", worker_id, followed.found.name)
        deadline = time.monotonic() + followed.found.drain_timeout_s
        while state is not None and state.inflight > 0 and self._registry.registered(state) \
                and time.monotonic() < deadline:
            await asyncio.sleep(_DRAIN_POLL_S)
        if state is not None and state.inflight > 0:
            log.warning("discovery: %s removed with %d requests still in flight (drain_timeout_s)", worker_id,
                        state.inflight)
        del followed.workers[endpoint]
        followed.draining.pop(endpoint, None)
        await self._publish()
        if state is not None and self._registry.registered(state):  # still wanted: another source names it
            self._registry.drain(worker_id, draining=False)
        else:
            log.info("discovery: %s removed", worker_id)

    async def _publish(self) -> None:
        async with self._lock:
            await self._apply(self.discovered())
