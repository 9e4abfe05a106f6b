"""run_in_background holds its tasks until they finish: a task nobody holds can be collected
by the garbage collector while it waits."""

from __future__ import annotations

import asyncio
import gc
import weakref

from deepinfer_gateway.gateway.serving import background


async def wait_forever(started: list[bool]) -> None:
    started.append(True)
    await asyncio.get_running_loop().create_future()  # a future only this coroutine holds


async def test_a_background_task_survives_a_collection_until_it_ends() -> None:
    started: list[bool] = []
    held = weakref.ref(background.run_in_background(wait_forever(started)))
    orphan = weakref.ref(asyncio.get_running_loop().create_task(wait_forever(started)))  # the control
    await asyncio.sleep(0)  # both start and wait
    assert started == [True, True]
    gc.collect()
    assert orphan() is None  # collected while waiting: its work would never finish
    task = held()
    assert task is not None and not task.done() and background.running() >= 1
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await asyncio.sleep(0)  # its done callbacks run on the next loop turn
    assert background.running() == 0
