"""Redis write load of N gateway replicas feeding one Redis index: write leases against none.

    python bench/kv_replicas.py [--redis-url URL] [--replicas 4] [--workers 64] [--rounds 100]

Every replica polls every worker (kvcache.events), so each worker's event batch reaches
`apply` once per replica. Without a lease (`writer_lease_s=0`) every replica sends it to
Redis, where the cursor makes all but the first a no-op; with the lease (the default,
3 s) the holder sends it and the others apply it to their local view only. Per mode, in
its own namespace, modes interleaved 3 times in one run (medians reported): EVALSHA calls
and Redis-side microseconds (INFO commandstats) per worker batch (one batch, however many
replicas applied it), the Redis process's CPU, the wall time of the replicas' applies,
and a check that Redis ends up holding every worker's blocks. Steady-state batches: `--events` events of
16 blocks per worker per round. Without --redis-url it starts its own Redis.
Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
import uuid
from typing import Any

import redis.asyncio as aioredis
from kv_index import redis_url_or_own

from deepinfer_gateway.core.protocol import KvEvent, KvEventBatch, KvEventKind, KvTier
from deepinfer_gateway.infra.redis_conn import redis_client
from deepinfer_gateway.kvcache.redis_index import RedisPrefixIndex

HASHES_PER_EVENT = 16


def worker_rounds(workers: int, rounds: int, events: int, rng: random.Random) -> dict[str, list[KvEventBatch]]:
    out: dict[str, list[KvEventBatch]] = {}
    for w in range(workers):
        seq, batches = 0, []
        for _ in range(rounds):
            evs = []
            for _ in range(events):
                seq += 1
                evs.append(KvEvent(seq=seq, kind=KvEventKind.STORED, tier=KvTier.MEMORY,
                                   block_hashes=[rng.getrandbits(63) for _ in range(HASHES_PER_EVENT)]))
            batches.append(KvEventBatch(worker_id=f"w{w}", epoch="e1", events=evs, last_seq=seq, oldest_seq=1))
        out[f"w{w}"] = batches
    return out


async def redis_cpu_s(admin: aioredis.Redis) -> float:
    info = await admin.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


async def run_mode(url: str, lease_s: float, replicas: int, feed: dict[str, list[KvEventBatch]]) -> dict[str, Any]:
    namespace = f"bench-replicas:{uuid.uuid4().hex[:8]}"
    indexes = [RedisPrefixIndex(redis_client(url), namespace=namespace, writer_lease_s=lease_s)
               for _ in range(replicas)]
    admin = aioredis.from_url(url)
    try:
        await admin.config_resetstat()
        cpu0, t0 = await redis_cpu_s(admin), time.perf_counter()
        rounds = len(next(iter(feed.values())))
        for r in range(rounds):  # each round: every replica applies every worker's new batch
            for index in indexes:
                await asyncio.gather(*(index.apply(w, batches[r]) for w, batches in feed.items()))
        wall = time.perf_counter() - t0
        cpu = await redis_cpu_s(admin) - cpu0
        evalsha = (await admin.info("commandstats")).get("cmdstat_evalsha", {"calls": 0, "usec": 0})
        expected = sum(len(e.block_hashes) for bs in feed.values() for b in bs for e in b.events)
        held = sum([await admin.scard(indexes[0].mem_key(w)) for w in feed])
        batches = sum(len(bs) for bs in feed.values())  # worker batches, each applied by every replica
        deferred = sum(i.metrics.registry.get_sample_value("dgw_kv_index_writes_deferred_total") or 0
                       for i in indexes)
        return {"writer_lease_s": lease_s, "redis_calls_per_batch": round(evalsha["calls"] / batches, 3),
                "redis_usec_per_batch": round(evalsha["usec"] / batches, 2), "redis_cpu_s": round(cpu, 3),
                "wall_s": round(wall, 3), "batches_deferred": int(deferred),
                "redis_holds_all_blocks": held == expected}
    finally:
        for index in indexes:
            await index.aclose()
        await admin.aclose()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--redis-url", default=None)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--workers", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--events", type=int, default=4, help="events (of 16 blocks) per worker batch")
    parser.add_argument("--lease-s", type=float, default=3.0)
    args = parser.parse_args()
    feed = worker_rounds(args.workers, args.rounds, args.events, random.Random(7))
    modes = []
    with redis_url_or_own(args.redis_url) as url:
        for lease_s in (0.0, args.lease_s) * 3:  # interleaved: the machine's noise hits both
            modes.append(await run_mode(url, lease_s, args.replicas, feed))
            print(json.dumps(modes[-1]))
    none = [m for m in modes if m["writer_lease_s"] == 0]
    lease = [m for m in modes if m["writer_lease_s"] > 0]

    def median_of(ms: list[dict[str, Any]], key: str) -> float:
        return float(statistics.median(m[key] for m in ms))

    summary = {
        "replicas": args.replicas, "workers": args.workers, "rounds": args.rounds,
        "no_lease_redis_calls_per_batch": median_of(none, "redis_calls_per_batch"),
        "lease_redis_calls_per_batch": median_of(lease, "redis_calls_per_batch"),
        "no_lease_redis_usec_per_batch": median_of(none, "redis_usec_per_batch"),
        "lease_redis_usec_per_batch": median_of(lease, "redis_usec_per_batch"),
        "no_lease_redis_cpu_s": median_of(none, "redis_cpu_s"), "lease_redis_cpu_s": median_of(lease, "redis_cpu_s"),
        "no_lease_wall_s": median_of(none, "wall_s"), "lease_wall_s": median_of(lease, "wall_s"),
        "redis_holds_all_blocks": all(m["redis_holds_all_blocks"] for m in modes),
    }
    for name, key in (("redis_usec_ratio", "redis_usec_per_batch"), ("redis_cpu_ratio", "redis_cpu_s"),
                      ("wall_ratio", "wall_s")):  # no lease / lease
        summary[name] = round(summary[f"no_lease_{key}"] / max(summary[f"lease_{key}"], 1e-9), 2)
    print(json.dumps(summary))


if __name__ == "__main__":
    asyncio.run(main())
