"""KV index benchmark: hashing, lookups (memory, Redis), Redis event ingestion.

    python bench/kv_index.py [--redis-url redis://127.0.0.1:6379/0] [--blocks 1000000]

Indexes `--blocks` memory-tier blocks over 64 workers (plus the prompt's own blocks:
fully cached on one worker, half on another, three quarters in the store), then
measures: hashing a 131,072-token prompt (median; `hash_131k_ms` is the gateway's path,
where the prompt encoder hands over the tokens already packed, recipe_bridge/encoder.py;
`hash_131k_from_list_ms` packs a plain id list first), a lookup for that prompt with all 64
workers as candidates (p99) in memory and through Redis (round trips counted by the
connection: requests actually written per lookup), the rate of block events
ingested into the Redis-backed index (local view + Redis), and the longest PING another
client sees while a 1M-block worker snapshot is pushed (what a gap in Redis's cursor
triggers): staged in chunks as the index does, against one script call holding it all. Without --redis-url it starts
its own Redis on a free port. Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import sys
import time
import uuid
from collections.abc import Awaitable, Iterator
from typing import Any

from deepinfer_gateway.core.protocol import KvEvent, KvEventBatch, KvEventKind, KvTier
from deepinfer_gateway.infra.redis_conn import GatewayTcpConnection, redis_client
from deepinfer_gateway.infra.redis_process import NoRedisServerBinary, RedisProcess, redis_server_binary
from deepinfer_gateway.kvcache.hashing import block_hashes, kv_salt, pack_tokens
from deepinfer_gateway.kvcache.lua import STAGE_SCRIPT, Script
from deepinfer_gateway.kvcache.memory import InMemoryPrefixIndex
from deepinfer_gateway.kvcache.redis_index import RedisPrefixIndex, pack_hashes

WORKERS = 64
PROMPT_TOKENS = 131_072
HASHES_PER_EVENT = 16
EVENTS_PER_BATCH = 250  # 4,000 block events per poll
# The benchmark's clients wait this long for a reply: the gateway's fail-fast 0.5 s would turn
# a snapshot upload or the one-call baseline (which holds Redis ~1 s by design) on a busy
# machine into a TimeoutError instead of a measured stall.
PATIENT_TIMEOUT_S = 60.0


class CountingConnection(GatewayTcpConnection):
    """Counts writes to the socket: one per round trip (a pipeline is one write)."""

    writes = 0

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        CountingConnection.writes += 1
        await super().send_packed_command(command, check_health)


def pct(samples: list[float], q: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, int(q * len(s)))]


@contextlib.contextmanager
def redis_url_or_own(url: str | None) -> Iterator[str]:
    """`url`, or the URL of a Redis of our own on a free port (redis_process.py picks the binary), killed on exit."""
    if url is not None:
        yield url
        return
    try:
        server_binary = redis_server_binary()
    except NoRedisServerBinary as e:
        sys.exit(f"{e}; or pass --redis-url")
    with RedisProcess() as server:
        print(f"started {server_binary} at {server.url}")
        yield server.url


def batches(n_blocks: int, prompt: list[int], rng: random.Random) -> dict[str, list[KvEventBatch]]:
    """Per worker, its event batches: `n_blocks` random blocks spread over the workers,
    plus the prompt (all on w0, half on w1) and 3/4 of it in the store."""
    per_worker: dict[str, list[KvEvent]] = {f"w{i}": [] for i in range(WORKERS)}
    seqs = dict.fromkeys(per_worker, 0)

    def add(worker: str, kind: KvEventKind, tier: KvTier, hashes: list[int], exp: float | None = None) -> None:
        seqs[worker] += 1
        per_worker[worker].append(KvEvent(seq=seqs[worker], kind=kind, tier=tier, block_hashes=hashes, expires_at=exp))

    for i in range(0, len(prompt), HASHES_PER_EVENT):
        add("w0", KvEventKind.STORED, KvTier.MEMORY, prompt[i : i + HASHES_PER_EVENT])
    for i in range(0, len(prompt) // 2, HASHES_PER_EVENT):
        add("w1", KvEventKind.STORED, KvTier.MEMORY, prompt[i : i + HASHES_PER_EVENT])
    exp = time.time() + 3 * 86400
    for i in range(0, len(prompt) * 3 // 4, HASHES_PER_EVENT):
        add("w2", KvEventKind.STORED, KvTier.STORE, prompt[i : i + HASHES_PER_EVENT], exp)
    remaining = n_blocks - len(prompt) - len(prompt) // 2
    per = remaining // WORKERS
    for w in per_worker:
        for i in range(0, per, HASHES_PER_EVENT):
            hs = [rng.getrandbits(63) for _ in range(min(HASHES_PER_EVENT, per - i))]
            add(w, KvEventKind.STORED, KvTier.MEMORY, hs)
    out: dict[str, list[KvEventBatch]] = {}
    for w, events in per_worker.items():
        out[w] = [
            KvEventBatch(
                worker_id=w, epoch="e1", events=events[i : i + EVENTS_PER_BATCH], last_seq=len(events), oldest_seq=1
            )
            for i in range(0, len(events), EVENTS_PER_BATCH)
        ]
    return out


async def ingest(index: Any, per_worker: dict[str, list[KvEventBatch]]) -> tuple[int, float]:
    """Apply every batch, workers concurrently (as the feeder does); returns block events, seconds."""
    n = sum(len(e.block_hashes) for bs in per_worker.values() for b in bs for e in b.events)

    async def feed(worker: str, bs: list[KvEventBatch]) -> None:
        for b in bs:
            await index.apply(worker, b)

    t0 = time.perf_counter()
    await asyncio.gather(*(feed(w, bs) for w, bs in per_worker.items()))
    return n, time.perf_counter() - t0


async def time_lookups(index: Any, hashes: dict[str, list[int]], workers: dict[str, str], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        await index.lookup(hashes, workers)
        out.append(time.perf_counter() - t0)
    return out


async def longest_ping_during(url: str, work: Awaitable[object]) -> tuple[float, float]:
    """Runs `work` while another client PINGs Redis back to back: (seconds of work, longest PING in ms)."""
    pinger = redis_client(url, timeout_s=PATIENT_TIMEOUT_S)
    pings: list[float] = []
    done = asyncio.Event()

    async def ping() -> None:
        while not done.is_set():
            t0 = time.perf_counter()
            await pinger.ping()
            pings.append(time.perf_counter() - t0)
            await asyncio.sleep(0.001)

    task = asyncio.create_task(ping())
    await asyncio.sleep(0.02)
    t0 = time.perf_counter()
    await work
    secs = time.perf_counter() - t0
    done.set()
    await task
    await pinger.aclose()
    return secs, max(pings) * 1e3


async def snapshot_stalls(index: RedisPrefixIndex, client: Any, url: str, blocks: int) -> dict[str, float]:
    """A replica whose local view holds a `blocks`-block worker that Redis lacks pushes its
    snapshot on the next batch; baseline: the same hashes added by one script call."""
    rng = random.Random(11)
    hashes = [rng.getrandbits(63) for _ in range(blocks)]

    def batch(seq: int, hs: list[int]) -> KvEventBatch:
        event = KvEvent(seq=seq, kind=KvEventKind.STORED, tier=KvTier.MEMORY, block_hashes=hs)
        return KvEventBatch(worker_id="big", epoch="e1", events=[event], last_seq=seq, oldest_seq=1)

    index.local.apply_now("big", batch(1, hashes))
    staged_s, staged_ms = await longest_ping_during(url, index.apply("big", batch(2, [rng.getrandbits(63)])))
    assert await client.scard(index.mem_key("big")) == blocks + 1
    scratch = index.mem_key("one-call")
    one_call = Script(STAGE_SCRIPT).run(client, [scratch], [60_000, pack_hashes(hashes)])
    one_s, one_ms = await longest_ping_during(url, one_call)
    await client.unlink(scratch)
    print(
        f"{blocks:,}-block snapshot push: staged {staged_s:.2f} s, longest PING {staged_ms:.1f} ms; "
        f"one script call {one_s:.2f} s, longest PING {one_ms:.1f} ms"
    )
    return {"snapshot_max_stall_ms": round(staged_ms, 1), "snapshot_one_call_max_stall_ms": round(one_ms, 1)}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url")
    parser.add_argument("--blocks", type=int, default=1_000_000)
    parser.add_argument("--lookups", type=int, default=2000)
    args = parser.parse_args()
    with redis_url_or_own(args.redis_url) as url:
        rng = random.Random(7)
        salt = kv_salt("DeepSeek-V4.1-Flash", "sm100")
        tokens = [rng.randrange(129_280) for _ in range(PROMPT_TOKENS)]
        packed = pack_tokens(tokens)
        samples: dict[str, list[float]] = {"packed": [], "list": []}
        for _ in range(200):  # interleaved: both see the same machine
            for path, given in (("packed", packed), ("list", None)):
                t0 = time.perf_counter()
                prompt = block_hashes(tokens, salt, packed=given)
                samples[path].append(time.perf_counter() - t0)
        hash_ms = statistics.median(samples["packed"]) * 1e3
        hash_list_ms = statistics.median(samples["list"]) * 1e3
        print(
            f"hash 131,072 tokens ({len(prompt)} blocks), packed by the encoder: "
            f"median {hash_ms:.3f} ms, p99 {pct(samples['packed'], 0.99) * 1e3:.3f} ms; "
            f"from a list: median {hash_list_ms:.3f} ms"
        )

        per_worker = batches(args.blocks, prompt, rng)
        workers = {f"w{i}": "sm100" for i in range(WORKERS)}
        hashes = {"sm100": prompt}

        memory = InMemoryPrefixIndex()
        n, secs = await ingest(memory, per_worker)
        print(f"in-memory ingest: {n:,} block events in {secs:.2f} s ({n / secs:,.0f}/s)")
        got = await memory.lookup(hashes, workers)
        print(f"overlap: w0={got.memory['w0']} w1={got.memory['w1']} store={got.store['sm100']} blocks")
        lat = await time_lookups(memory, hashes, workers, args.lookups)
        mem_p99 = pct(lat, 0.99) * 1e3
        print(f"lookup in memory, 64 candidates: p50 {pct(lat, 0.5) * 1e3:.3f} ms, p99 {mem_p99:.3f} ms")
        del memory

        # The gateway's client class (hiredis packing, blocking pool), with patient timeouts.
        client = redis_client(url, timeout_s=PATIENT_TIMEOUT_S, connection_class=CountingConnection)
        index = RedisPrefixIndex(client, namespace=f"bench:{uuid.uuid4().hex[:8]}")
        n, secs = await ingest(index, per_worker)
        events_per_s = n / secs
        print(
            f"Redis-backed ingest (local view + Redis, 64 workers concurrently): {n:,} block events "
            f"in {secs:.2f} s ({events_per_s:,.0f}/s)"
        )
        got = await index.lookup(hashes, workers)  # warm: loads the script
        assert got.memory["w0"] == len(prompt) and got.store["sm100"] == len(prompt) * 3 // 4, got
        writes0 = CountingConnection.writes
        await client.config_resetstat()
        lat = await time_lookups(index, hashes, workers, args.lookups)
        round_trips = (CountingConnection.writes - writes0) / args.lookups
        redis_p50, redis_p99 = pct(lat, 0.5) * 1e3, pct(lat, 0.99) * 1e3
        # Redis's own time per lookup script (the rest is the client, the network stack and scheduling).
        server_ms = (await client.info("commandstats"))["cmdstat_evalsha_ro"]["usec_per_call"] / 1e3
        print(
            f"lookup through Redis, 64 candidates: p50 {redis_p50:.3f} ms, p99 {redis_p99:.3f} ms "
            f"(Redis-side script {server_ms:.3f} ms mean), {round_trips:.2f} round trips per lookup"
        )
        info = await client.info("memory")
        print(f"Redis used_memory: {info['used_memory_human']}")
        stalls = await snapshot_stalls(index, client, url, 1_000_000)
        await client.flushdb()
        await index.aclose()
    print(
        json.dumps(
            {
                "hash_131k_ms": round(hash_ms, 3),
                "hash_131k_from_list_ms": round(hash_list_ms, 3),
                "lookup_memory_p99_ms": round(mem_p99, 3),
                "lookup_redis_p50_ms": round(redis_p50, 3),
                "lookup_redis_p99_ms": round(redis_p99, 3),
                "lookup_redis_server_ms": round(server_ms, 3),
                "redis_round_trips_per_lookup": round(round_trips, 3),
                "events_per_s": round(events_per_s),
                **stalls,
            }
        )
    )


if __name__ == "__main__":
    asyncio.run(main())
