"""Fire-and-forget work of the request path (an explicit abort, a rate-limit refund).

The event loop keeps only a weak reference to a task, so a task nobody holds may be
garbage-collected before it finishes (asyncio's `create_task` documentation): each one is
held here until it is done.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

_running: set[asyncio.Task[Any]] = set()


def run_in_background(work: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
    task = asyncio.get_running_loop().create_task(work)
    _running.add(task)
    task.add_done_callback(_running.discard)
    return task


def running() -> int:
    """How many are still running (tests)."""
    return len(_running)
