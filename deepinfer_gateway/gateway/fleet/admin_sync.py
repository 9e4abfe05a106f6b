"""`AdminSync`: applies admin changes (workers added or removed, routing policies) to this
replica, and, with Redis, to every replica.

Without Redis a change applies to the process that receives it, and lives as long as that
process. With Redis a change is written to the shared store (admin_store.py) first, so an
unreachable Redis refuses it (503) rather than splitting the replicas; then applied here,
then announced on the channel. Every replica re-reads the store on an announcement and
every `reconcile_interval_s` (a replica that missed a message, or lost its subscription,
catches up), and once at start (one started after a change has it before it serves).
A Redis that comes back without the admin state (its marker gone, admin_store.py) does
not wipe the changes: a replica that has them applied writes them back, and announces it.
Reconcile errors are counted (`dgw_redis_errors_total{component="admin"}`) and retried;
they never stop the replica, which keeps the state it last applied.

The workers DNS discovery finds (discovery.py, `set_discovered`) join the configured ones
here, so every source of workers goes through the one `_apply_workers`: added to the
registry and the KV event feeder, removed from both and from the prefix index.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable, Mapping
from typing import Any

from redis.exceptions import RedisError

from deepinfer_gateway.config import WorkerSpec
from deepinfer_gateway.core.errors import GatewayError
from deepinfer_gateway.core.outage import Outage
from deepinfer_gateway.gateway.fleet.admin_store import (
    CHANNEL,
    AdminSnapshot,
    AdminStore,
    WorkerEntry,
    desired_workers,
    routing_inputs,
)
from deepinfer_gateway.gateway.fleet.registry import WorkerRegistry, WorkerState
from deepinfer_gateway.gateway.fleet.worker_allow import WorkerAllowList
from deepinfer_gateway.kvcache.events import KvEventFeeder
from deepinfer_gateway.router.planner import RoutePlanner

log = logging.getLogger(__name__)

RECONCILE_INTERVAL_S = 2.0
_RESUBSCRIBE_S = 1.0


class SharedStateUnavailable(GatewayError):
    """A shared admin change refused because Redis did not take it: no replica changed."""

    status_code = 503

    def __init__(self, why: Exception):
        super().__init__(f"Admin changes are shared through Redis, which is unavailable ({type(why).__name__}); "
                         "nothing was changed. Retry when Redis is back.", code="admin_state_unavailable")


class AdminSync:
    def __init__(self, store: AdminStore | None, registry: WorkerRegistry, feeder: KvEventFeeder,
                 planner: RoutePlanner, static: tuple[WorkerSpec, ...], on_error: Callable[[], None],
                 reconcile_interval_s: float = RECONCILE_INTERVAL_S, allow: WorkerAllowList | None = None):
        self._store = store
        self._allow = allow or WorkerAllowList.build((), static)
        self._refused: set[tuple[str, WorkerEntry]] = set()  # shared entries this replica left out, logged once
        self._registry = registry
        self._feeder = feeder
        self._planner = planner
        self._static = static
        self._on_error = on_error
        self._interval = reconcile_interval_s
        self._entries: dict[str, WorkerEntry] = {}  # this replica's own changes, without Redis
        self._discovered: dict[str, WorkerSpec] = {}  # found by DNS (discovery.py), by worker id
        self._routing: dict[str, str] = {}  # routing fields applied (field -> JSON), as stored
        self._lock = asyncio.Lock()  # one change or reconcile at a time
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        # A Redis outage: each failure counted, logged when it starts and when it ends (not every retry).
        self._reconcile_outage = Outage("admin state", "keeping the state last applied", on_error)
        self._channel_outage = Outage("admin channel", f"resubscribing every {_RESUBSCRIBE_S} s", on_error)

    @property
    def shared(self) -> bool:
        return self._store is not None

    async def start(self) -> None:
        if self._store is None:
            return
        await self.reconcile_safely()
        self._tasks = [asyncio.create_task(self._reconcile_loop(), name="admin-reconcile"),
                       asyncio.create_task(self._listen(), name="admin-listen")]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []

    # --- changes from the admin API ------------------------------------------------------

    async def add_worker(self, spec: WorkerSpec) -> WorkerState:
        """WorkerNotAllowed (400) when the allow-list refuses one of its addresses."""
        self._allow.check(spec)
        await self._change_worker(spec.worker_id, WorkerEntry(spec=spec))
        await self._registry.check_all()
        return self._registry.workers[spec.worker_id]

    async def remove_worker(self, worker_id: str) -> bool:
        """False when no replica is known to serve it: not here, not added through the store."""
        known = worker_id in self._registry.workers
        if not known and self._store is not None:
            known = await self._read_or_refuse(lambda s: s.workers.get(worker_id, WorkerEntry()).spec is not None)
        if known:
            await self._change_worker(worker_id, WorkerEntry())
        return known

    async def set_routing(self, fields: Mapping[str, Any]) -> None:
        """`fields`: policy and/or decode_policy (name or table); ValueError if invalid, before any change."""
        self._planner.settings.with_policies(**fields)  # validates without applying
        if self._store is not None:
            await self._write_or_refuse(self._store.put_routing(fields))
        async with self._lock:
            self._apply_routing({**self._routing, **{k: json.dumps(v, sort_keys=True) for k, v in fields.items()}})
        await self._notify()

    async def _change_worker(self, worker_id: str, entry: WorkerEntry) -> None:
        if self._store is not None:
            await self._write_or_refuse(self._store.put_worker(worker_id, entry))
        async with self._lock:
            self._entries[worker_id] = entry
            await self._apply_workers(self._entries)
        await self._notify()

    async def _write_or_refuse(self, write: Any) -> None:
        try:
            await write
        except (RedisError, OSError) as exc:
            self._on_error()
            raise SharedStateUnavailable(exc) from None

    async def _read_or_refuse(self, check: Callable[[AdminSnapshot], bool]) -> bool:
        assert self._store is not None
        try:
            return check(await self._store.read())
        except (RedisError, OSError) as exc:
            self._on_error()
            raise SharedStateUnavailable(exc) from None

    async def _notify(self) -> None:
        if self._store is None:
            return
        try:
            await self._store.notify()
        except (RedisError, OSError) as exc:  # stored already: the others converge at their next reconcile
            self._on_error()
            log.warning("admin change stored but not announced: %s", exc)

    async def set_discovered(self, specs: Mapping[str, WorkerSpec]) -> None:
        """The workers DNS discovery found now (by id): applied with the configured and admin ones."""
        async with self._lock:
            self._discovered = dict(specs)
            await self._apply_workers(self._entries)

    # --- applying the shared state -------------------------------------------------------

    async def reconcile(self) -> None:
        """Read the shared state and apply it; raises redis' errors."""
        assert self._store is not None
        snapshot = await self._store.read()
        if not snapshot.kept and not snapshot.lost:
            await self._store.mark_kept()  # stored before the marker existed
        elif snapshot.lost and (self._entries or self._routing):
            if await self._store.restore(self._entries, self._routing):
                log.warning("admin state: Redis had lost it; written back from this replica (%d worker "
                            "entries, routing %s)", len(self._entries), sorted(self._routing))
                await self._notify()
            snapshot = await self._store.read()
        for worker_id in snapshot.invalid:
            self._on_error()
            log.warning("admin state: undecodable entry for worker %s left out", worker_id)
        async with self._lock:
            self._entries = snapshot.workers
            await self._apply_workers(snapshot.workers)
            if snapshot.routing != self._routing:
                self._apply_routing(snapshot.routing)

    async def reconcile_safely(self) -> None:
        try:
            await self.reconcile()
        except (RedisError, OSError) as exc:
            self._reconcile_outage.failed(exc)
        else:
            self._reconcile_outage.ok()

    async def _apply_workers(self, entries: Mapping[str, WorkerEntry]) -> None:
        want = desired_workers(self._static, self._admitted(entries), self._discovered)
        have = {worker_id: w.spec for worker_id, w in self._registry.workers.items()}
        gone = [worker_id for worker_id, spec in have.items() if want.get(worker_id) != spec]
        new = [spec for worker_id, spec in want.items() if have.get(worker_id) != spec]
        for worker_id in gone:
            self._registry.remove(worker_id)
            await self._feeder.remove_worker(worker_id)
            log.info("worker %s removed", worker_id)
        for spec in new:
            worker = self._registry.add(spec)
            self._feeder.add(worker.worker_id, worker.upstream.kv_source())
            log.info("worker %s added", spec.worker_id)
        if new:
            await self._registry.check_all()  # routable now, not at the next health round

    def _admitted(self, entries: Mapping[str, WorkerEntry]) -> dict[str, WorkerEntry]:
        """The entries this replica's allow-list admits: a shared one written by a replica with a
        wider list (or straight into Redis) is left out here, and logged once."""
        out = {}
        for worker_id, entry in entries.items():
            why = None if entry.spec is None else self._allow.refusal(entry.spec)
            if why is None:
                out[worker_id] = entry
            elif (worker_id, entry) not in self._refused:
                self._refused.add((worker_id, entry))
                log.warning("admin state: worker %s left out: %s", worker_id, why)
        return out

    def _apply_routing(self, routing: dict[str, str]) -> None:
        try:
            self._planner.reconfigure(**routing_inputs(routing))
        except ValueError as exc:  # written by a replica that accepts what this one does not
            self._on_error()
            log.warning("admin state: routing %s not applied: %s", routing, exc)
        else:
            log.info("routing policies set: policy=%s decode_policy=%s", self._planner.settings.policy.name,
                     self._planner.settings.decode_policy.name)
        self._routing = routing

    async def _reconcile_loop(self) -> None:
        while True:
            # asyncio.timeout, not wait_for: before Python 3.12 wait_for drops a cancel (stop)
            # that lands as the wake-up does, and this loop would never end.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._interval):
                    await self._wake.wait()
            self._wake.clear()
            await self.reconcile_safely()

    async def _listen(self) -> None:
        """Wake the reconcile loop on every announcement; resubscribe after a failure."""
        assert self._store is not None
        while True:
            pubsub = self._store.pubsub()
            try:
                await pubsub.subscribe(CHANNEL)
                self._channel_outage.ok()
                self._wake.set()  # anything announced while unsubscribed
                while True:
                    # Blocks until a message (no polling timer: an idle replica does not wake); a
                    # connection that dies silently is covered by the reconcile loop's interval.
                    if await pubsub.get_message(ignore_subscribe_messages=True, timeout=None) is not None:
                        self._wake.set()
            except (RedisError, OSError) as exc:
                self._channel_outage.failed(exc)
            finally:
                with contextlib.suppress(RedisError, OSError):
                    await pubsub.aclose()
            await asyncio.sleep(_RESUBSCRIBE_S)
