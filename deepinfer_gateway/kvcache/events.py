"""Gateway-side KV event feeder: long-polls every worker's event log into a PrefixIndex.

One asyncio task per worker loops `GET {base_url}/v1/worker/kv_events?after=C&limit=N&wait_ms=W`
(reply: `protocol.KvEventBatch` JSON) and hands the batch to `index.apply`, whose return
value is the next cursor C. The index owns all sequencing decisions (new epoch, gap,
falling behind `oldest_seq` -> drop the worker's memory tier, cursor 0 = re-read from
the oldest retained event); the feeder only fetches, so it behaves the same over both
backends.

Long poll: with `wait_s` > 0 the worker holds the request until it has events past C
(or C is not its last seq, e.g. a cursor from a previous epoch: the reply then carries the
new epoch) or `wait_s` passes, so an idle worker costs one request per `wait_s` (default
1 s) instead of one per `interval_s`, and the first event after a quiet spell reaches the
index one round trip after the worker logged it. `interval_s` (default 50 ms) stays the
shortest period between two polls unless a backlog is pending, so a busy worker is still
polled at most 1/`interval_s` times a second (later events of a burst wait up to that
long), and a worker that ignores `wait_ms` (older builds, test doubles) answers at once
and is polled every `interval_s`, as without the long poll. `wait_s` = 0 turns it off.

Cost and bounds: back-to-back requests while a worker has more than `limit` events
pending; at most `limit` events per request and one request in flight per worker. Each
request's timeout is `timeout_s` on top of the wait, so a held request is never cut short.
A failing worker is retried with exponential backoff up to `max_backoff_s` and logged once
per outage. Cancel-safe: `aclose()` stops every task; cancelling a held request closes its
connection, which ends the wait on the worker too.
The `aiohttp.ClientSession` is injected (the gateway's shared upstream session; tests
pass their own) and never closed here. A held request keeps one pooled connection busy
per worker; the gateway's connector has no connection limit, so it never starves the
generate requests.

Pushed: a `PolledKvLog` with a `push` (a worker protocol v2 connection, kvcache/pushed.py)
is not polled while that connection is up and pushing: the feeder subscribes on it from its
cursor and applies each batch the worker sends, through the same `index.apply` (so the same
epoch, gap and resync rules; a batch the index does not continue from makes it resubscribe
from the cursor the index returned). When the connection closes, the next poll goes out at
once, from the cursor: nothing the worker logged meanwhile is lost.

`add(worker_id, source)` follows a worker by the KV event source its upstream adapter offers
(gateway/upstream/base.py; the feeder never asks which engine a worker runs): a `PolledKvLog` is
long-polled as above; a `ZmqKvPublisher` (vLLM's) is followed by a `VllmKvSubscriber` on its
ZMQ events instead (vllm_events.py). Its hashes are salted by the model and KV format the
worker reports, so its task first asks the source's `salt()` (a probe of the worker),
retrying with backoff while the worker is unreachable.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp
from pydantic import ValidationError

from deepinfer_gateway.core.errors import UpstreamError
from deepinfer_gateway.core.protocol import KV_EVENTS_PATH, MAX_KV_EVENTS_WAIT_MS, KvEventBatch
from deepinfer_gateway.kvcache.pushed import KvPush
from deepinfer_gateway.kvcache.types import PrefixIndex
from deepinfer_gateway.kvcache.vllm_events import VllmKvSubscriber


@dataclass(frozen=True)
class PolledKvLog:
    """A worker-protocol worker's KV event log, long-polled at `url` + KV_EVENTS_PATH unless
    `push` (its v2 connection) is up and pushing it."""

    url: str
    push: KvPush | None = field(default=None, compare=False)


@dataclass(frozen=True)
class ZmqKvPublisher:
    """A vLLM worker's KV events publisher (ZMQ PUB, optional ROUTER replay); `salt` learns its
    hashes' salt from the worker (an UpstreamError while it is unreachable)."""

    endpoint: str
    replay_endpoint: str
    topic: str
    salt: Callable[[], Awaitable[bytes]]


KvSource = PolledKvLog | ZmqKvPublisher

# The longest `wait_ms` a worker grants (docs/worker-protocol.md, KV events); asking for
# more gets a 400, which would stall the feed.
MAX_WAIT_S = MAX_KV_EVENTS_WAIT_MS / 1000
IDLE_CHECK_S = 3.0  # a pushing worker's feed re-checks the index this often while nothing comes

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Worker:
    worker_id: str
    base_url: str
    cursor: int = 0
    push: KvPush | None = field(default=None, repr=False)
    task: asyncio.Task[None] | None = field(default=None, repr=False)
    vllm: VllmKvSubscriber | None = field(default=None, repr=False)  # a vLLM worker's, once started


class KvEventFeeder:
    def __init__(
        self,
        index: PrefixIndex,
        session: aiohttp.ClientSession,
        *,
        interval_s: float = 0.05,
        wait_s: float = 1.0,
        limit: int = 2000,
        timeout_s: float = 2.0,
        max_backoff_s: float = 5.0,
    ) -> None:
        if not 0 <= wait_s <= MAX_WAIT_S:
            raise ValueError(f"wait_s must be within 0..{MAX_WAIT_S:g} s, got {wait_s}")
        self.index = index
        self._session = session
        self.interval_s = interval_s
        self.wait_s = wait_s
        self.limit = limit
        self._timeout = aiohttp.ClientTimeout(total=wait_s + timeout_s)
        self.max_backoff_s = max_backoff_s
        self._workers: dict[str, _Worker] = {}

    def add_worker(self, worker_id: str, base_url: str, push: KvPush | None = None) -> None:
        """Start feeding from a worker (idempotent; a new URL restarts its task)."""
        known = self._workers.get(worker_id)
        if known is not None and known.base_url == base_url.rstrip("/"):
            return
        if known is not None and known.task is not None:
            known.task.cancel()
        worker = _Worker(worker_id, base_url.rstrip("/"), push=push)
        worker.task = asyncio.get_running_loop().create_task(self._run(worker), name=f"kv-events:{worker_id}")
        self._workers[worker_id] = worker

    def add(self, worker_id: str, source: KvSource | None) -> None:
        """Start feeding from a worker by the KV event source it offers (None: nothing to follow)."""
        if isinstance(source, PolledKvLog):
            self.add_worker(worker_id, source.url, source.push)
        elif isinstance(source, ZmqKvPublisher):
            if worker_id in self._workers:
                return
            worker = _Worker(worker_id, "")
            worker.task = asyncio.get_running_loop().create_task(self._follow_zmq(worker, source),
                                                                 name=f"kv-events:{worker_id}")
            self._workers[worker_id] = worker

    async def remove_worker(self, worker_id: str, *, forget: bool = True) -> None:
        """Stop feeding; with `forget`, also drop the worker from the index."""
        worker = self._workers.pop(worker_id, None)
        if worker is not None:
            await self._stop(worker)
        if forget:
            await self.index.remove_worker(worker_id)

    def cursor(self, worker_id: str) -> int | None:
        worker = self._workers.get(worker_id)
        return None if worker is None else worker.cursor

    async def poll_once(self, worker_id: str) -> bool:
        """Fetch and apply one batch; True when the worker has more events waiting."""
        worker = self._workers[worker_id]
        return await self._poll(worker)

    async def aclose(self) -> None:
        workers = list(self._workers.values())
        self._workers.clear()
        for worker in workers:
            if worker.task is not None:
                worker.task.cancel()
        for worker in workers:
            await self._stop(worker)

    @staticmethod
    async def _stop(worker: _Worker) -> None:
        if worker.task is not None:
            worker.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await worker.task
        if worker.vllm is not None:
            await worker.vllm.aclose()

    async def _follow_zmq(self, worker: _Worker, source: ZmqKvPublisher) -> None:
        """Learn the worker's salt (retrying while it is unreachable), then subscribe."""
        failures = 0
        while True:
            try:
                salt = await source.salt()
                break
            except (UpstreamError, aiohttp.ClientError, TimeoutError) as exc:
                failures += 1
                if failures == 1:
                    log.warning("kv events: %s not reachable yet (%s); retrying with backoff", worker.worker_id, exc)
                await asyncio.sleep(min(self.max_backoff_s, self.interval_s * 2**failures))
        subscriber = VllmKvSubscriber(self.index, worker.worker_id, source.endpoint,
                                      source.replay_endpoint or None, salt, topic=source.topic)
        worker.vllm = subscriber
        await subscriber.start()

    async def _poll(self, worker: _Worker, wait: bool = False) -> bool:
        params = {"after": str(worker.cursor), "limit": str(self.limit)}
        if wait and self.wait_s > 0:
            params["wait_ms"] = str(round(self.wait_s * 1000))
        async with self._session.get(worker.base_url + KV_EVENTS_PATH, params=params, timeout=self._timeout) as resp:
            resp.raise_for_status()
            body = await resp.read()
        batch = KvEventBatch.model_validate_json(body)
        worker.cursor = await self.index.apply(worker.worker_id, batch)
        return bool(batch.events) and worker.cursor < batch.last_seq

    async def _follow_push(self, worker: _Worker, push: KvPush) -> None:
        """Apply what the worker pushes until its connection goes (module doc). A worker with
        nothing to push sends nothing, so every IDLE_CHECK_S the last batch is applied again
        with no events: as an empty long-poll reply did, it lets the index see that its store
        lost the worker's blocks (a Redis restarted empty) and write them back."""
        generation = push.generation
        failures = 0
        last: KvEventBatch | None = None
        push.subscribe(worker.cursor, self.interval_s, self.limit)
        while True:
            try:
                async with asyncio.timeout(IDLE_CHECK_S):  # not wait_for: it can swallow a cancellation
                    batch = await push.next(generation)
            except TimeoutError:
                if last is None:
                    continue
                batch = last.model_copy(update={"events": [], "last_seq": worker.cursor})
            if batch is None:
                return
            last = batch
            try:
                cursor = await self.index.apply(worker.worker_id, batch)
            except Exception:  # a bug or a backend failure: re-read from the cursor after a pause
                failures += 1
                if failures == 1:
                    log.exception("kv events: applying %s's pushed events failed; retrying with backoff",
                                  worker.worker_id)
                await asyncio.sleep(min(self.max_backoff_s, self.interval_s * 2**failures))
                push.subscribe(worker.cursor, self.interval_s, self.limit)
                continue
            failures = 0
            worker.cursor = cursor
            if cursor != (batch.events[-1].seq if batch.events else batch.last_seq):
                push.subscribe(cursor, self.interval_s, self.limit)  # the index re-reads from elsewhere

    async def _run(self, worker: _Worker) -> None:
        loop = asyncio.get_running_loop()
        failures = 0
        while True:
            push = worker.push
            if push is not None and push.live:
                await self._follow_push(worker, push)
                continue  # the connection went: poll from the cursor, at once if it is down
            started = loop.time()
            try:
                more = await self._poll(worker, wait=True)
            except (aiohttp.ClientError, TimeoutError, ValidationError) as exc:
                failures += 1
                if failures == 1:
                    log.warning("kv events: polling %s failed (%s); retrying with backoff", worker.worker_id, exc)
                await asyncio.sleep(min(self.max_backoff_s, self.interval_s * 2**failures))
                continue
            except Exception:  # a bug must not silently stop this worker's feed
                failures += 1
                if failures == 1:
                    log.exception("kv events: applying %s's events failed; retrying with backoff", worker.worker_id)
                await asyncio.sleep(min(self.max_backoff_s, self.interval_s * 2**failures))
                continue
            if failures:
                log.warning("kv events: %s reachable again after %d failed polls", worker.worker_id, failures)
                failures = 0
            if not more:  # a long poll that waited has used up the interval already
                await asyncio.sleep(max(0.0, self.interval_s - (loop.time() - started)))
