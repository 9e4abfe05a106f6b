"""Long-poll waits on the workers' KV event logs: sim (event loop) and DeepInfer (step thread)."""

from __future__ import annotations

import asyncio
import threading

from deepinfer_gateway.core.protocol import KvEventKind, KvTier
from deepinfer_gateway.workers.deepinfer.events import KvEventLog
from deepinfer_gateway.workers.sim.kv_events import SimKvEventLog


async def timed(coro: object) -> float:
    loop = asyncio.get_running_loop()
    started = loop.time()
    await coro  # type: ignore[misc]
    return loop.time() - started


async def test_sim_log_wait_returns_at_the_next_append() -> None:
    log = SimKvEventLog("w")
    waiting = asyncio.create_task(timed(log.wait_past(log.last_seq, 10)))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    log.append(KvEventKind.STORED, KvTier.MEMORY, [1, 2])
    took = await asyncio.wait_for(waiting, 1)
    assert took < 1 and [e.seq for e in log.batch(1).events] == [2]  # waited (not done above), woke at the append


async def test_sim_log_wait_times_out_and_skips_when_behind() -> None:
    log = SimKvEventLog("w")
    assert 0.1 <= await timed(log.wait_past(log.last_seq, 0.1)) < 1
    assert await timed(log.wait_past(0, 10)) < 0.05  # events past the cursor: no wait
    assert await timed(log.wait_past(log.last_seq + 9, 10)) < 0.05  # a cursor from another epoch


async def test_sim_log_empty_appends_do_not_wake() -> None:
    log = SimKvEventLog("w")
    waiting = asyncio.create_task(log.wait_past(log.last_seq, 10))
    await asyncio.sleep(0.02)
    log.append(KvEventKind.STORED, KvTier.MEMORY, [])  # logs nothing
    await asyncio.sleep(0.05)
    assert not waiting.done()
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)


async def test_deepinfer_log_wakes_waiters_from_the_step_thread() -> None:
    log = KvEventLog("w")
    log.restart()
    waiters = [asyncio.create_task(timed(log.wait_past(1, 10))) for _ in range(3)]
    await asyncio.sleep(0.05)
    assert not any(w.done() for w in waiters)
    thread = threading.Thread(target=log.append, args=(KvEventKind.STORED, KvTier.MEMORY, [7]))
    thread.start()
    took = await asyncio.wait_for(asyncio.gather(*waiters), 1)
    thread.join()
    # Each waited (not done before the append) and woke at it, long before its 10 s. No lower
    # bound: a busy box starts the tasks late in the 50 ms sleep, so they waited less than it.
    assert all(t < 1 for t in took)
    assert 0.1 <= await timed(log.wait_past(2, 0.1)) < 1


async def test_deepinfer_log_restart_wakes_waiters() -> None:
    log = KvEventLog("w")
    log.restart()
    for _ in range(4):
        log.append(KvEventKind.STORED, KvTier.MEMORY, [1])
    waiting = asyncio.create_task(timed(log.wait_past(5, 10)))
    await asyncio.sleep(0.02)
    log.restart()  # new epoch: last_seq is 1, the waiter's cursor is stale
    assert await asyncio.wait_for(waiting, 1) < 1
