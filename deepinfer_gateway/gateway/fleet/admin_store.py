"""Admin changes shared by every gateway replica through Redis: what is stored, and the pure
rule that turns it into the worker set a replica should serve.

Keys, all under the `{dgw:admin}` hash tag (one slot, so it runs unchanged on Redis Cluster):

- `{dgw:admin}:workers`, a hash: worker id -> `WorkerEntry` JSON, either the spec an
  operator added (`POST /admin/workers`) or a tombstone (`DELETE /admin/workers/{id}`).
  Tombstones are kept, not deleted, because a removed worker may be a static `[[workers]]`
  entry of some replica's config: the tombstone keeps it out on every replica, including
  one that starts later, until an operator adds it again.
- `{dgw:admin}:routing`, a hash: `policy` / `decode_policy` -> the JSON of the last value
  set (`PUT /admin/routing`); a field never set leaves the replica's configured policy.
- `{dgw:admin}:kept`, a string written with every change: its absence with both hashes
  empty means Redis lost the admin state (a volume lost, a Redis without persistence), not
  that nothing was ever changed, so a replica that still holds the state writes it back
  (`restore`, AdminSync.reconcile).
- `{dgw:admin}:changed`, a pub/sub channel: a message (its payload is ignored) asks every
  replica to re-read the keys above.

State, not operations, is stored: a replica that missed messages, or starts later, reads
the keys and converges on the same result (`desired_workers`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from pydantic import BaseModel, ConfigDict

from deepinfer_gateway.config import WorkerSpec

TAG = "{dgw:admin}"
WORKERS_KEY = f"{TAG}:workers"
ROUTING_KEY = f"{TAG}:routing"
KEPT_KEY = f"{TAG}:kept"
CHANNEL = f"{TAG}:changed"
ROUTING_FIELDS = ("policy", "decode_policy")


class WorkerEntry(BaseModel):
    """One worker's admin record: `spec` when added, None when removed (a tombstone)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    spec: WorkerSpec | None = None


@dataclass(frozen=True)
class AdminSnapshot:
    """The shared admin state as read: worker entries by id (undecodable ones left out and
    named in `invalid`), and the routing fields set (field -> its JSON)."""

    workers: dict[str, WorkerEntry]
    routing: dict[str, str]
    invalid: tuple[str, ...] = ()
    kept: bool = True  # the KEPT_KEY marker was there

    @property
    def lost(self) -> bool:
        """Redis lost what was stored (or nothing was ever stored: the same to a reader)."""
        return not self.kept and not self.workers and not self.routing and not self.invalid


def desired_workers(static: Iterable[WorkerSpec], entries: Mapping[str, WorkerEntry],
                    discovered: Mapping[str, WorkerSpec] | None = None) -> dict[str, WorkerSpec]:
    """The workers a replica serves: its configured ones, then the ones DNS discovery found
    (a configured id wins), each replaced by an added spec of the same id, plus every other
    added one, less the tombstoned ids."""
    out = {**(discovered or {}), **{spec.worker_id: spec for spec in static}}
    for worker_id, entry in entries.items():
        if entry.spec is None:
            out.pop(worker_id, None)
        else:
            out[worker_id] = entry.spec
    return out


def routing_inputs(routing: Mapping[str, str]) -> dict[str, Any]:
    """The stored routing fields as `RoutePlanner.reconfigure` keyword arguments."""
    return {field: json.loads(routing[field]) for field in ROUTING_FIELDS if field in routing}


class AdminStore:
    """Reads and writes the keys above. Every method raises redis' errors as they come:
    callers decide between answering 503 (a write) and counting and retrying (a reconcile)."""

    def __init__(self, redis: aioredis.Redis):
        self._r = redis

    async def put_worker(self, worker_id: str, entry: WorkerEntry) -> None:
        async with self._r.pipeline(transaction=True) as pipe:
            pipe.hset(WORKERS_KEY, worker_id, entry.model_dump_json())
            pipe.set(KEPT_KEY, b"1")
            await pipe.execute()

    async def put_routing(self, fields: Mapping[str, Any]) -> None:
        async with self._r.pipeline(transaction=True) as pipe:
            pipe.hset(ROUTING_KEY, mapping={k: json.dumps(v, sort_keys=True) for k, v in fields.items()})
            pipe.set(KEPT_KEY, b"1")
            await pipe.execute()

    async def mark_kept(self) -> None:
        await self._r.set(KEPT_KEY, b"1")

    async def restore(self, workers: Mapping[str, WorkerEntry], routing: Mapping[str, str]) -> bool:
        """Write a replica's applied state back into a Redis that lost it; False (nothing
        written) when the marker is back already: another replica, or a new change, was first."""
        args: list[Any] = [len(workers)]
        for worker_id, entry in workers.items():
            args += [worker_id, entry.model_dump_json()]
        for field, value in routing.items():
            args += [field, value]
        return bool(await self._r.eval(_RESTORE, 3, KEPT_KEY, WORKERS_KEY, ROUTING_KEY, *args))

    async def read(self) -> AdminSnapshot:
        async with self._r.pipeline(transaction=True) as pipe:  # one consistent view
            pipe.hgetall(WORKERS_KEY)
            pipe.hgetall(ROUTING_KEY)
            pipe.exists(KEPT_KEY)
            raw_workers, raw_routing, kept = await pipe.execute()
        workers, invalid = {}, []
        for key, value in raw_workers.items():
            worker_id = _text(key)
            try:
                workers[worker_id] = WorkerEntry.model_validate_json(value)
            except ValueError:
                invalid.append(worker_id)
        routing = {_text(k): _text(v) for k, v in raw_routing.items() if _text(k) in ROUTING_FIELDS}
        return AdminSnapshot(workers, routing, tuple(invalid), kept=bool(kept))

    async def notify(self) -> None:
        await self._r.publish(CHANNEL, b"1")

    def pubsub(self) -> Any:
        """A pub/sub connection (redis-py's PubSub, or the cluster client's ClusterPubSub)."""
        return self._r.pubsub()


# KEYS: kept, workers, routing; ARGV: n, n (worker id, entry JSON) pairs, then (field, JSON) pairs.
_RESTORE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
local n = tonumber(ARGV[1])
for i = 0, n - 1 do redis.call('HSET', KEYS[2], ARGV[2 + 2 * i], ARGV[3 + 2 * i]) end
for i = 2 + 2 * n, #ARGV, 2 do redis.call('HSET', KEYS[3], ARGV[i], ARGV[i + 1]) end
redis.call('SET', KEYS[1], '1')
return 1
"""


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
