"""Where request preparation runs: on the event loop, in one dedicated thread, or in
asyncio's default executor, chosen by body size and the offload mode.

`RequestPreparer` hands its work to `PrepareOffload.run`; this module owns the mode
(`DGW_PREPARE_OFFLOAD`), the size threshold and the GIL switch interval it sets.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")

OFFLOAD_BODY_BYTES = 64 * 1024
# How bodies over OFFLOAD_BODY_BYTES are prepared: "thread" (default), one dedicated thread,
# with the GIL switch interval lowered to PREPARE_SWITCH_INTERVAL_S; "pool": asyncio's
# default executor (several at once); "loop": inline. Bodies with images always go to the
# default executor. "MODE@MS" also sets the switch interval (ms). The environment variable
# overrides the default (bench/relay_under_prep.py compares them).
OFFLOAD_MODES = ("thread", "pool", "loop")
OFFLOAD_ENV = "DGW_PREPARE_OFFLOAD"
PREPARE_SWITCH_INTERVAL_S = 0.0005


def parse_offload(spec: str) -> tuple[str, float | None]:
    """"MODE[@MS]" -> (mode, switch interval in s or None)."""
    mode, _, ms = spec.partition("@")
    if mode not in OFFLOAD_MODES:
        raise ValueError(f"preparation offload must be one of {OFFLOAD_MODES} (optionally @MS), not {spec!r}")
    return mode, (float(ms) / 1000 if ms else None)


class PrepareOffload:
    """Runs preparation work where it stalls other streams least.

    Large bodies are prepared in ONE dedicated thread, one after another, and the process's
    GIL switch interval is lowered to 0.5 ms (from Python's 5 ms). Why (docs/simulate.md,
    bench/relay_under_prep.py): preparation holds the GIL for part of its work (JSON and
    template in the library, list building, packing; tiktoken's BPE releases it), and every
    time the event loop gives the GIL up for a socket call it waits up to one switch interval
    to get it back, several times per relayed token. With asyncio's default executor a burst
    of big prompts ran in several threads at once, each competing with the loop: every other
    stream's first token and inter-token gaps grew by tens to hundreds of ms. One thread keeps
    it to one competitor (a burst is prepared back to back: on a quiet machine its median
    prompt waits ~10% longer), and the short interval bounds each wait. Preparing inline on
    the loop is worse: the loop stops for the whole preparation (~60 ms per 80k tokens cold).
    The interval is process-wide; its cost was not measurable (docs/simulate.md).
    """

    def __init__(self, spec: str | None = None, image_slots: int = 4):
        self.mode, switch_s = parse_offload(spec or os.environ.get(OFFLOAD_ENV) or "thread")
        if switch_s is not None:
            sys.setswitchinterval(switch_s)
        elif self.mode == "thread":
            sys.setswitchinterval(min(sys.getswitchinterval(), PREPARE_SWITCH_INTERVAL_S))
        # Decoding holds memory by pixels: a bounded number of requests decode their images at once.
        self._image_slots = asyncio.Semaphore(image_slots)
        # The thread starts on first use.
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="prepare") if self.mode == "thread" else None

    async def run(self, work: Callable[..., T], *args: Any) -> T:
        """`work(*args)`, whose last argument is the request body, run where the body says."""
        body: bytes = args[-1]
        if b"image" in body:  # may wait on remote fetches: never queue prompts behind them
            async with self._image_slots:
                return await asyncio.to_thread(work, *args)
        if len(body) > OFFLOAD_BODY_BYTES and self.mode != "loop":
            if self._executor is None:
                return await asyncio.to_thread(work, *args)
            return await asyncio.get_running_loop().run_in_executor(self._executor, work, *args)
        return work(*args)
