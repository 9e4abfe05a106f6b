"""DNS discovery's pure parts and its state machine on a scripted lookup: the spec a found
address becomes, how configured, discovered and admin workers combine, a vanished address
drained until its requests finish, one that comes back, and a failed lookup changing nothing.
The real resolver against a real DNS server is tests/e2e/test_discovery.py."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import pytest
from pydantic import ValidationError

from deepinfer_gateway.config import DgwWorkerSpec, DiscoverySpec, HealthSettings, WorkerEngine, WorkerSpec
from deepinfer_gateway.core import protocol as wp
from deepinfer_gateway.gateway.fleet.admin_store import WorkerEntry, desired_workers
from deepinfer_gateway.gateway.fleet.discovery import WorkerDiscovery, nameserver, worker_spec
from deepinfer_gateway.gateway.fleet.endpoints import Endpoint, LookupFailed
from deepinfer_gateway.gateway.fleet.registry import WorkerRegistry
from deepinfer_gateway.gateway.telemetry.metrics import GatewayMetrics
from deepinfer_gateway.gateway.upstream.dgw import DgwUpstream

FOUND = DiscoverySpec(name="pool.dgw.test", port=8100, drain_timeout_s=5)


def info(role: wp.Role = wp.Role.DECODE) -> wp.WorkerInfo:
    return wp.WorkerInfo(worker_id="w", engine="sim", role=role, hardware=wp.Hardware.ASCEND950, kv_format="fp8",
                         model="m", epoch="e1")


def test_a_found_worker_takes_its_reported_role_and_hardware_unless_the_entry_sets_them() -> None:
    spec = worker_spec(FOUND, Endpoint("10.0.0.7", 8100), info())
    assert (spec.url, spec.worker_id, spec.role, spec.hardware) == (
        "http://10.0.0.7:8100", "10.0.0.7:8100", wp.Role.DECODE, wp.Hardware.ASCEND950)
    pinned = FOUND.model_copy(update={"role": wp.Role.PREFILL, "hardware": wp.Hardware.SM100, "pool": "fast"})
    spec = worker_spec(pinned, Endpoint("fd00::7", 9000), info())
    assert (spec.url, spec.role, spec.hardware, spec.pool) == ("http://[fd00::7]:9000", wp.Role.PREFILL,
                                                               wp.Hardware.SM100, "fast")


def test_a_vllm_pool_takes_role_hardware_and_kv_events_from_its_entry() -> None:
    found = DiscoverySpec(name="vllm.dgw.test", engine=WorkerEngine.VLLM, hardware=wp.Hardware.SM100,
                          kv_events_port=5557, model="m")
    spec = worker_spec(found, Endpoint("10.0.0.8", 8000), None)
    assert (spec.engine, spec.kv_events_endpoint, spec.model) == (WorkerEngine.VLLM, "tcp://10.0.0.8:5557", "m")


@pytest.mark.parametrize(("fields", "message"), [
    ({"engine": "vllm"}, "set hardware"),
    ({"engine": "openai", "hardware": "sm100", "role": "decode"}, "role must be unified"),
    ({"model": "m"}, "model applies"),
    ({"kv_events_port": 5557}, "kv_events_port applies"),
    ({"nameservers": ["127.0.0.1:dns"]}, "IP:PORT"),
])
def test_discovery_entries_refuse_what_they_cannot_honour(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        DiscoverySpec(name="pool.dgw.test", **fields)


def test_nameservers_with_and_without_port() -> None:
    assert (nameserver("127.0.0.1:5353").address, nameserver("127.0.0.1:5353").port) == ("127.0.0.1", 5353)
    assert (nameserver("::1").address, nameserver("::1").port) == ("::1", 53)


def test_configured_workers_win_over_discovered_ones_and_tombstones_remove_both() -> None:
    static = DgwWorkerSpec(url="http://10.0.0.1:8100", role=wp.Role.PREFILL)
    found = {f"10.0.0.{i}:8100": DgwWorkerSpec(url=f"http://10.0.0.{i}:8100") for i in (1, 2)}
    want = desired_workers([static], {}, found)
    assert want["10.0.0.1:8100"] is static and set(want) == {"10.0.0.1:8100", "10.0.0.2:8100"}
    assert set(desired_workers([static], {"10.0.0.2:8100": WorkerEntry()}, found)) == {"10.0.0.1:8100"}


class ScriptedLookup:
    """Answers with `addresses`, or fails while `failing`."""

    def __init__(self) -> None:
        self.addresses: set[str] = set()
        self.failing = False

    async def resolve(self) -> set[Endpoint]:
        if self.failing:
            raise LookupFailed("timed out")
        return {Endpoint(a, 8100) for a in self.addresses}

    async def changed(self, timeout_s: float) -> None:
        await asyncio.sleep(timeout_s)

    async def aclose(self) -> None:
        pass


class InfoClient:
    """Answers /v1/worker/info and /v1/worker/load for every address (stands in for the HttpPool),
    and builds the worker protocol's adapter on itself."""

    mux = False  # HttpPool's worker protocol v2 switch: these checks are v1's probes

    async def get_json(self, url: str, path: str) -> dict[str, Any]:
        if path == wp.INFO_PATH:
            return info().model_dump(mode="json")
        return wp.LoadReport(worker_id="w", role=wp.Role.DECODE, hardware=wp.Hardware.ASCEND950, kv_format="fp8",
                             running=0, waiting=0, queued_prefill_tokens=0, kv_usage=0.0, memory_capacity_blocks=1,
                             dp_ranks=[], epoch="e1").model_dump(mode="json")

    def upstream(self, spec: Any) -> DgwUpstream:
        pool: Any = self
        return DgwUpstream(spec, pool)


class Rig:
    def __init__(self, static: tuple[WorkerSpec, ...] = ()) -> None:
        self.lookup = ScriptedLookup()
        self.static = {spec.worker_id: spec for spec in static}
        client: Any = InfoClient()
        self.registry = WorkerRegistry(static, client, HealthSettings(), GatewayMetrics())
        self.discovery = WorkerDiscovery((FOUND,), client, self.registry, self.apply, lambda _: self.lookup)
        self.followed = self.discovery._followed[0]

    async def apply(self, specs: Mapping[str, WorkerSpec]) -> None:
        """What AdminSync does (desired_workers, no admin changes): the registry follows."""
        want = desired_workers(self.static.values(), {}, specs)
        for worker_id in set(self.registry.workers) - set(want):
            self.registry.remove(worker_id)
        for spec in want.values():
            self.registry.add(spec)
        await self.registry.check_all()

    async def round(self, *addresses: str) -> None:
        self.lookup.addresses = set(addresses)
        await self.discovery.refresh(self.followed)


async def test_a_vanished_address_drains_until_its_requests_finish_then_goes() -> None:
    rig = Rig()
    await rig.round("10.0.0.1", "10.0.0.2")
    assert sorted(w.worker_id for w in rig.registry.healthy()) == ["10.0.0.1:8100", "10.0.0.2:8100"]
    leaving = rig.registry.workers["10.0.0.2:8100"]
    assert leaving.spec.role is wp.Role.DECODE  # probed
    leaving.inflight = 1
    await rig.round("10.0.0.1")
    await asyncio.sleep(0.2)
    assert leaving.draining and rig.registry.registered(leaving)  # kept while its request runs
    assert [w.worker_id for w in rig.registry.healthy()] == ["10.0.0.1:8100"]  # but given nothing new
    leaving.inflight = 0
    await asyncio.sleep(0.2)
    assert list(rig.registry.workers) == ["10.0.0.1:8100"]
    await rig.discovery.stop()


async def test_an_address_back_before_its_drain_ends_is_taken_back() -> None:
    rig = Rig()
    await rig.round("10.0.0.1")
    worker = rig.registry.workers["10.0.0.1:8100"]
    worker.inflight = 1
    await rig.round()
    await asyncio.sleep(0.1)
    assert worker.draining and rig.registry.healthy() == []
    await rig.round("10.0.0.1")
    assert not worker.draining and rig.registry.healthy() == [worker]
    worker.inflight = 0
    await asyncio.sleep(0.2)
    assert rig.registry.workers == {"10.0.0.1:8100": worker}
    await rig.discovery.stop()


async def test_a_failed_lookup_changes_nothing_an_empty_answer_removes_all() -> None:
    rig = Rig()
    await rig.round("10.0.0.1", "10.0.0.2")
    rig.lookup.failing = True
    await rig.discovery.refresh(rig.followed)
    await asyncio.sleep(0.1)
    assert len(rig.registry.healthy()) == 2
    rig.lookup.failing = False
    await rig.round()
    await asyncio.sleep(0.2)
    assert rig.registry.workers == {}
    await rig.discovery.stop()


async def test_a_configured_worker_that_dns_also_names_is_never_drained_by_it() -> None:
    static = DgwWorkerSpec(url="http://10.0.0.1:8100", role=wp.Role.PREFILL, hardware=wp.Hardware.SM100)
    rig = Rig((static,))
    await rig.round("10.0.0.1", "10.0.0.2")
    await rig.round("10.0.0.2")
    await asyncio.sleep(0.2)
    configured = rig.registry.workers["10.0.0.1:8100"]
    assert configured.spec is static and not configured.draining
    assert sorted(w.worker_id for w in rig.registry.healthy()) == ["10.0.0.1:8100", "10.0.0.2:8100"]
    await rig.discovery.stop()
