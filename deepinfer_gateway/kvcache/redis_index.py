"""Redis prefix index: one shared view for any number of gateway replicas.

Choose it when more than one gateway replica routes to the same workers (they then
agree on where a prefix is cached); design, keys and scaling in docs/kv-index.md.

Every replica polls every worker (kvcache.events) and calls `apply`, which
1. applies the batch to this replica's local `InMemoryPrefixIndex` (the feeder's cursor,
   and the view lookups fall back to), then
2. runs ONE Lua script that applies the same events to Redis idempotently: a per-worker
   cursor (epoch, last seq) in Redis makes a batch another replica already wrote a
   no-op, so N replicas write each event once. When Redis cannot follow (its cursor has
   a gap, or it lost its data: the `alive` marker is gone), the replica pushes its local
   snapshot of that worker (or everything) instead.
3. Per worker, one replica writes: the script takes or renews a write lease
   (`writer_lease_s`) for the caller, or answers with the holder's remaining lease time,
   during which this replica applies that worker's batches to its local view only. N
   replicas thus send each batch to Redis once (plus one attempt per lease period each),
   not N times. A replica that dies or can no longer reach the worker stops renewing; the
   next replica to write after the lease lapses takes over (filling any gap in Redis with
   its snapshot, point 2). `writer_lease_s=0`: every replica writes (idempotently).

`lookup` is ONE round trip (EVALSHA of a read-only script; EVAL only right after Redis
lost its script cache). Its Redis-side cost grows with the candidates' hit lengths (one
membership test per cached leading block, plus ~2 log2(n) probes per candidate that hits):
0.71-1.46 ms for a 1,024-block prompt cached on 2 of 64 candidates and in the store, on
the 2-core dev box (bench/kv_index.py; docs/kv-index.md has the inverted layout that
would make it one MGET).

Redis unavailable: lookups are served from the local view, failures are counted in
`dgw_kv_index_errors_total{op}` and logged once per outage; Redis is retried at most
every `retry_interval_s`, and the first successful `apply` after an outage pushes the
full local view (every worker's memory tier and the store tier) before Redis serves
lookups again.

Keys (all under one hash tag, so scripts work on Redis Cluster): block hashes are stored
as 8-byte little-endian strings.
  {ns}:store         ZSET  member=hash, score=expires_at (unix s); capped, purged on apply
  {ns}:store:set     SET   the same members (lookups test membership: 3x cheaper than scores)
  {ns}:mem:<worker>  SET   the worker's memory-tier hashes; capped; idle TTL
  {ns}:cur:<worker>  HASH  e=epoch, s=last applied seq (-1: fresh); idle TTL
  {ns}:alive         STR   marker; missing means Redis lost its data -> full resync
  {ns}:writer:<worker>  STR  the replica holding the worker's write lease; PX lease
  {ns}:staged:<worker>:<id>  SET  a snapshot being uploaded; renamed to mem when complete; TTL
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
import uuid
from array import array
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from deepinfer_gateway.core.protocol import KvEventBatch, KvEventKind, KvTier
from deepinfer_gateway.kvcache.lua import APPLY_SCRIPT, LOOKUP_SCRIPT, SNAPSHOT_SCRIPT, STAGE_SCRIPT, Script
from deepinfer_gateway.kvcache.memory import InMemoryPrefixIndex
from deepinfer_gateway.kvcache.types import DEFAULT_STORE_TTL_S, KvIndexMetrics, Overlap

log = logging.getLogger(__name__)

_BIG_ENDIAN = sys.byteorder == "big"
_EVENT_CODES = {
    (KvTier.MEMORY, KvEventKind.STORED): b"ms",
    (KvTier.MEMORY, KvEventKind.EVICTED): b"me",
    (KvTier.MEMORY, KvEventKind.CLEARED): b"mc",
    (KvTier.STORE, KvEventKind.STORED): b"ss",
    (KvTier.STORE, KvEventKind.EVICTED): b"se",
    (KvTier.STORE, KvEventKind.CLEARED): b"sc",
}
_STATUS_OK, _STATUS_GAP, _STATUS_WIPED, _STATUS_NOT_WRITER = 0, 1, 2, 3
_SNAPSHOT_CHUNK = 50_000  # store entries per ZADD during a full resync
_STAGE_CHUNK = 8_192  # memory-tier hashes per upload call of a worker snapshot (~5 ms of Redis)
_STAGE_TTL_MS = 60_000


def pack_hashes(hashes: Sequence[int]) -> bytes:
    words = array("Q", hashes)
    if _BIG_ENDIAN:
        words.byteswap()
    return words.tobytes()


class RedisPrefixIndex:
    def __init__(
        self,
        client: aioredis.Redis,
        *,
        namespace: str = "dgw:kv",
        local: InMemoryPrefixIndex | None = None,
        metrics: KvIndexMetrics | None = None,
        max_blocks_per_worker: int = 1 << 20,
        max_store_blocks: int = 4_000_000,
        default_store_ttl_s: float = DEFAULT_STORE_TTL_S,
        worker_idle_ttl_s: float = 3600.0,
        retry_interval_s: float = 1.0,
        writer_lease_s: float = 3.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._r = client
        self._tag = "{" + namespace + "}"
        self.local = local or InMemoryPrefixIndex(
            max_blocks_per_worker=max_blocks_per_worker,
            max_store_blocks=max_store_blocks,
            default_store_ttl_s=default_store_ttl_s,
            clock=clock,
        )
        self.metrics = metrics or KvIndexMetrics()
        self.max_blocks_per_worker = max_blocks_per_worker
        self.max_store_blocks = max_store_blocks
        self.default_store_ttl_s = default_store_ttl_s
        self._idle_ttl_ms = int(worker_idle_ttl_s * 1000)
        self.retry_interval_s = retry_interval_s
        self.replica_id = uuid.uuid4().hex
        self._lease_ms = int(writer_lease_s * 1000)
        self._writer_elsewhere_until: dict[str, float] = {}  # worker -> monotonic time its lease may lapse
        self._clock = clock
        self._apply = Script(APPLY_SCRIPT)
        self._lookup = Script(LOOKUP_SCRIPT)
        self._snapshot = Script(SNAPSHOT_SCRIPT)
        self._stage = Script(STAGE_SCRIPT)
        self._locks: dict[str, asyncio.Lock] = {}
        self._resync_lock = asyncio.Lock()
        # Outage state: Redis is used for lookups only while `healthy`; after a failure
        # it is retried from `retry_at`, and `needs_full_resync` is served first.
        self.healthy = True
        self._needs_full_resync = False
        self._retry_at = 0.0

    # --- keys -----------------------------------------------------------------------------

    @property
    def store_key(self) -> str:
        return f"{self._tag}:store"

    @property
    def store_set_key(self) -> str:
        return f"{self._tag}:store:set"

    @property
    def alive_key(self) -> str:
        return f"{self._tag}:alive"

    def mem_key(self, worker_id: str) -> str:
        return f"{self._tag}:mem:{worker_id}"

    def cur_key(self, worker_id: str) -> str:
        return f"{self._tag}:cur:{worker_id}"

    def writer_key(self, worker_id: str) -> str:
        return f"{self._tag}:writer:{worker_id}"

    # --- PrefixIndex ----------------------------------------------------------------------

    async def apply(self, worker_id: str, batch: KvEventBatch) -> int:
        lock = self._locks.setdefault(worker_id, asyncio.Lock())
        async with lock:  # one worker's batches reach Redis in order
            cursor = self.local.apply_now(worker_id, batch)
            if time.monotonic() < self._writer_elsewhere_until.get(worker_id, 0.0):
                self.metrics.writes_deferred.inc()  # the lease holder writes this batch
                return cursor
            if not self._redis_due():
                # Not sent: Redis misses this batch until a full resync, so an apply that
                # succeeds meanwhile must not declare Redis current again.
                self._needs_full_resync = True
                return cursor
            try:
                if self._needs_full_resync:
                    await self._push_all()
                # Idempotent: a no-op when the push above already carried this batch.
                status, value = await self._apply_redis(worker_id, batch)
                if status == _STATUS_NOT_WRITER:
                    self.metrics.writes_deferred.inc()
                    self._writer_elsewhere_until[worker_id] = time.monotonic() + max(0, value) / 1000
                elif status == _STATUS_GAP:
                    await self._push_worker(worker_id)
                elif status == _STATUS_WIPED:
                    self._needs_full_resync = True
                    await self._push_all()
            except RedisError as exc:
                self._failed("apply", exc)
            else:
                self._recovered()
            return cursor

    async def remove_worker(self, worker_id: str) -> None:
        await self.local.remove_worker(worker_id)
        self._locks.pop(worker_id, None)
        self._writer_elsewhere_until.pop(worker_id, None)
        if not self._redis_due():
            return
        try:
            await self._r.unlink(self.mem_key(worker_id), self.cur_key(worker_id))
        except RedisError as exc:
            self._failed("remove_worker", exc, writes_lost=False)

    async def lookup(self, hashes: Mapping[str, Sequence[int]], workers: Mapping[str, str]) -> Overlap:
        if not self.healthy or self._needs_full_resync:
            # Only `apply` (the feeders, in the background) probes a failed Redis, so a
            # lookup never waits on a connect timeout.
            return self.local.lookup_now(hashes, workers)
        if not any(hashes.values()):  # a prompt shorter than one block: nothing to ask Redis
            return Overlap(memory=dict.fromkeys(workers, 0), store=dict.fromkeys(hashes, 0))
        keys: list[str] = [self.store_key, self.store_set_key]
        args: list[Any] = [self._clock(), len(hashes)]
        order: list[tuple[str, list[str]]] = []
        for fmt, hs in hashes.items():
            members = [w for w, f in workers.items() if f == fmt]
            args += [pack_hashes(hs), len(members)]
            keys += [self.mem_key(w) for w in members]
            order.append((fmt, members))
        try:
            reply = await self._lookup.run(self._r, keys, args, read_only=True)
        except RedisError as exc:
            self._failed("lookup", exc, writes_lost=False)
            return self.local.lookup_now(hashes, workers)
        memory = dict.fromkeys(workers, 0)
        store: dict[str, int] = {}
        it = iter(reply)
        for fmt, members in order:
            store[fmt] = int(next(it))
            for w in members:
                memory[w] = int(next(it))
        return Overlap(memory=memory, store=store)

    async def stats(self) -> dict[str, Any]:
        """The local view's stats, plus what Redis holds (one pipelined round trip), so an
        operator can see the two diverge; Redis errors are reported, not raised."""
        out = self.local.stats_now() | {"backend": "redis"}
        now = time.monotonic()
        redis_view: dict[str, Any] = {
            "healthy": self.healthy, "needs_full_resync": self._needs_full_resync, "replica_id": self.replica_id,
            "writer_lease_s": self._lease_ms / 1000,
            "workers_written_elsewhere": sorted(w for w, t in self._writer_elsewhere_until.items() if now < t)}
        out["redis"] = redis_view
        workers = list(out["workers"])
        try:
            async with self._r.pipeline(transaction=False) as pipe:
                for w in workers:
                    pipe.scard(self.mem_key(w))
                pipe.zcard(self.store_key)
                replies = await pipe.execute()
        except RedisError as exc:
            redis_view["error"] = f"{type(exc).__name__}: {exc}"
            return out
        for w, blocks in zip(workers, replies, strict=False):
            out["workers"][w]["redis_memory_blocks"] = blocks
        redis_view["store_entries"] = replies[-1]
        return out

    async def aclose(self) -> None:
        await self._r.aclose()

    # --- resync -----------------------------------------------------------------------------

    async def _push_all(self) -> None:
        """Push the whole local view to Redis (after a failed write or a wiped Redis)."""
        async with self._resync_lock:
            if not self._needs_full_resync:
                return  # another task just did it
            for worker_id in self.local.workers():
                await self._push_worker(worker_id)
            items = self.local.store_items()
            async with self._r.pipeline(transaction=False) as pipe:
                for i in range(0, len(items), _SNAPSHOT_CHUNK):
                    chunk = items[i : i + _SNAPSHOT_CHUNK]
                    mapping = {pack_hashes([h]): exp for h, exp in chunk}
                    pipe.zadd(self.store_key, mapping, gt=True)
                    pipe.sadd(self.store_set_key, *mapping)
                pipe.set(self.alive_key, b"1")
                await pipe.execute()
            self._needs_full_resync = False

    async def _push_worker(self, worker_id: str) -> None:
        """Replace the worker's memory tier in Redis by the local view's: uploaded in small
        calls to a staging key, then swapped in by one O(1) script."""
        cur = self.local.cursor(worker_id)
        if cur is None:
            return
        staged = f"{self._tag}:staged:{worker_id}:{uuid.uuid4().hex}"
        hashes = list(self.local.memory_blocks(worker_id))
        for i in range(0, len(hashes), _STAGE_CHUNK):
            await self._stage.run(self._r, [staged], [_STAGE_TTL_MS, pack_hashes(hashes[i : i + _STAGE_CHUNK])])
        await self._snapshot.run(
            self._r,
            [self.mem_key(worker_id), self.cur_key(worker_id), self.alive_key, staged],
            [cur.epoch, cur.last_seq, self._idle_ttl_ms],
        )

    # --- internals ----------------------------------------------------------------------------

    async def _apply_redis(self, worker_id: str, batch: KvEventBatch) -> tuple[int, int]:
        """(status, last applied seq), or (_STATUS_NOT_WRITER, the holder's lease ms left)."""
        now = self._clock()
        args: list[Any] = [
            batch.epoch,
            batch.oldest_seq,
            now,
            self.max_blocks_per_worker,
            self.max_store_blocks,
            self._idle_ttl_ms,
            now + self.default_store_ttl_s,
            self.replica_id,
            self._lease_ms,
        ]
        for event in batch.events:
            expires = b"" if event.expires_at is None else event.expires_at
            args += [event.seq, _EVENT_CODES[(event.tier, event.kind)], expires, pack_hashes(event.block_hashes)]
        keys = [self.mem_key(worker_id), self.cur_key(worker_id), self.store_key, self.store_set_key, self.alive_key,
                self.writer_key(worker_id)]
        status, value = await self._apply.run(self._r, keys, args)
        return int(status), int(value)

    def _redis_due(self) -> bool:
        return self.healthy or self._clock() >= self._retry_at

    def _failed(self, op: str, exc: Exception, *, writes_lost: bool = True) -> None:
        self.metrics.error(op)
        self._retry_at = self._clock() + self.retry_interval_s
        self._needs_full_resync = self._needs_full_resync or writes_lost
        if self.healthy:
            self.healthy = False
            log.warning("prefix index: Redis unavailable (%s: %s); serving from the local view", op, exc)

    def _recovered(self) -> None:
        if not self.healthy and not self._needs_full_resync:
            self.healthy = True
            log.warning("prefix index: Redis is back; lookups use Redis again")
