"""The KV event feeder on pushed batches (kvcache/pushed.py, kvcache/events.py): a worker's real
event log and the real in-memory index; the v2 connection's part (sending the subscription,
handing over each batch) is played by the test, the connection itself is covered end to end
in tests/e2e/test_worker_pushes.py."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp

from deepinfer_gateway.core.protocol import KvEventBatch, KvEventKind, KvTier
from deepinfer_gateway.kvcache.events import KvEventFeeder, PolledKvLog
from deepinfer_gateway.kvcache.memory import InMemoryPrefixIndex
from deepinfer_gateway.kvcache.pushed import KvPush
from deepinfer_gateway.workers.pushes import push_kv_events
from deepinfer_gateway.workers.sim.kv_events import SimKvEventLog
from tests.fault_doubles import until


async def test_a_new_epoch_makes_the_feeder_resubscribe_and_stale_batches_are_skipped() -> None:
    subscriptions: list[tuple[int, int]] = []  # (after, sub) as the worker would read them

    def subscribe(after: int, sub: int, interval_ms: int, limit: int) -> bool:
        subscriptions.append((after, sub))
        return True

    old, new = SimKvEventLog("w"), SimKvEventLog("w")  # the worker before and after a restart
    for i in range(3):
        old.append(KvEventKind.STORED, KvTier.MEMORY, [100 + i])
        new.append(KvEventKind.STORED, KvTier.MEMORY, [200 + i])
    push = KvPush()
    push.attach(subscribe)
    async with aiohttp.ClientSession() as session:
        feeder = KvEventFeeder(InMemoryPrefixIndex(), session, interval_s=0.01)
        feeder.add("w", PolledKvLog("http://127.0.0.1:9", push))  # never polled: the push is live
        try:
            await until(lambda: subscriptions == [(0, 1)])
            push.deliver(1, old.batch(0))
            await until(lambda: feeder.cursor("w") == old.last_seq == 4)
            # The worker restarted (another epoch): read from the old cursor, its log has nothing
            # past it; the index drops the worker and asks for everything from its oldest event.
            push.deliver(1, new.batch(4))
            await until(lambda: subscriptions[-1] == (0, 2))
            push.deliver(1, new.batch(4))  # sent before the worker read the new subscription
            push.deliver(2, new.batch(0))
            await until(lambda: feeder.cursor("w") == new.last_seq)
            assert subscriptions == [(0, 1), (0, 2)]
            # Detached (the connection closed): the feeder polls, here an unreachable address.
            push.detach(subscribe)
            await until(lambda: not push.live)
        finally:
            await feeder.aclose()


class _Log:
    """The two Engine methods the KV pusher reads, over a real worker event log."""

    def __init__(self, log: SimKvEventLog) -> None:
        self.log = log

    def kv_events(self, after: int, limit: int = 10_000) -> KvEventBatch:
        return self.log.batch(after, limit)

    async def wait_kv_events(self, after: int, timeout_s: float) -> None:
        await self.log.wait_past(after, timeout_s)


async def test_the_worker_sends_the_first_batch_at_once_then_only_new_events() -> None:
    log = SimKvEventLog("w")
    for i in range(3):
        log.append(KvEventKind.STORED, KvTier.MEMORY, [300 + i])
    sent: list[KvEventBatch] = []
    engine: Any = _Log(log)
    # A cursor equal to this log's last seq, from the worker's previous epoch: only the epoch of
    # the first batch, sent without waiting for an event, tells the gateway.
    pusher = asyncio.create_task(push_kv_events(engine, log.last_seq, 100, 0.0, sent.append))
    try:
        await until(lambda: len(sent) == 1)
        assert sent[0].events == [] and sent[0].epoch == log.epoch and sent[0].last_seq == 4
        await asyncio.sleep(0.05)
        assert len(sent) == 1  # nothing new: nothing sent
        log.append(KvEventKind.STORED, KvTier.MEMORY, [400])
        await until(lambda: len(sent) == 2)
        assert [e.seq for e in sent[1].events] == [5]
    finally:
        pusher.cancel()
