"""relay.py's `_resume`: a write the direct path started in the v2 reader's call and that
had to wait (the client's socket full) is finished by the relay's own task, as an `await`
of it would have: it goes on where it waited, its result and errors come out in the task,
and cancelling the task cancels it where it waits."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from deepinfer_gateway.gateway.serving.relay import _resume


class FlowControlled:
    """A send that waits until the transport is writable (as uvicorn's does), then writes."""

    def __init__(self) -> None:
        self.writable = asyncio.Event()
        self.written: list[bytes] = []
        self.log: list[str] = []

    async def send(self, body: bytes) -> None:
        try:
            await self.writable.wait()
            await asyncio.sleep(0)  # a second wait inside the same write
            self.written.append(body)
        except asyncio.CancelledError:
            self.log.append("cancelled")
            raise


def started(write: Any) -> Any:
    """Run `write` (an awaitable's iterator) up to its first wait outside any task, as the direct
    path does."""
    waiting_on = next(write)
    assert isinstance(waiting_on, asyncio.Future) and not waiting_on.done()
    return waiting_on


async def test_a_started_write_is_finished_by_the_task() -> None:
    flow = FlowControlled()
    write = flow.send(b"chunk").__await__()
    waiting_on = started(write)
    task = asyncio.ensure_future(_resume(write, waiting_on))
    await asyncio.sleep(0.01)
    assert not task.done() and flow.written == []  # still waiting for the client
    flow.writable.set()
    await asyncio.wait_for(task, 1)
    assert flow.written == [b"chunk"]


async def test_an_error_inside_the_write_comes_out_in_the_task() -> None:
    ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def failing() -> None:
        await ready
        raise OSError("client gone")

    write = failing().__await__()
    task = asyncio.ensure_future(_resume(write, started(write)))
    ready.set_result(None)
    with pytest.raises(OSError, match="client gone"):
        await asyncio.wait_for(task, 1)


async def test_cancelling_the_task_cancels_the_write_where_it_waits() -> None:
    flow = FlowControlled()
    write = flow.send(b"chunk").__await__()
    task = asyncio.ensure_future(_resume(write, started(write)))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert flow.log == ["cancelled"] and flow.written == []
