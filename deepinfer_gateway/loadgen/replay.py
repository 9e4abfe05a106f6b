"""Replaying a workload against a server: open loop on the trace clock, or closed loop.

- open loop: request i is sent at `arrival_s / speedup` after the start, whatever
  the server does (it measures queueing). `send_lag_s` records how late the client
  was; a large lag means the client, not the server, limited the run.
- closed loop: `concurrency` users, each sending its next request as soon as its
  previous one ends (trace order, arrival times ignored).

Bounds: `max_requests` (count), `duration_s` (no request is sent after it), then
in-flight requests get `drain_timeout_s` to finish before they are cancelled and
recorded as `cancelled`. The process's own CPU time over the run is measured with
`time.process_time` (all threads).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from deepinfer_gateway.workload.types import RequestRecord, TraceRequest


class Sender(Protocol):
    async def send(self, prompt: str, max_tokens: int, record: RequestRecord) -> None: ...


@dataclass(frozen=True)
class ReplayConfig:
    mode: str = "open"  # "open" | "closed"
    speedup: float = 1.0
    concurrency: int = 16
    duration_s: float | None = None
    drain_timeout_s: float = 60.0
    progress: bool = True


@dataclass
class ReplayResult:
    records: list[RequestRecord]
    wall_s: float
    client_cpu_s: float  # the whole process over the run, prompt synthesis included
    synthesis_cpu_s: float  # of which: building prompt texts


class Progress:
    def __init__(self, total: int, enabled: bool):
        from tqdm import tqdm

        self.bar = tqdm(total=total, disable=not enabled, unit="req", smoothing=0.1, mininterval=0.5)
        self.errors = 0

    def done(self, record: RequestRecord) -> None:
        if not record.ok:
            self.errors += 1
            self.bar.set_postfix(errors=self.errors, refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


async def replay(requests: Sequence[TraceRequest], prompt_for: Callable[[TraceRequest], str], sender: Sender,
                 config: ReplayConfig) -> ReplayResult:
    records: list[RequestRecord] = []
    progress = Progress(len(requests), config.progress)
    cpu0 = time.process_time()
    start = time.perf_counter()
    deadline = start + config.duration_s if config.duration_s else None
    ends: list[float] = []
    synthesis_cpu = 0.0

    def prompt(request: TraceRequest) -> str:
        nonlocal synthesis_cpu
        t0 = time.process_time()
        text = prompt_for(request)
        synthesis_cpu += time.process_time() - t0
        return text

    async def one(request: TraceRequest, lag: float | None, text: str | None = None) -> None:
        record = RequestRecord(index=request.index, arrival_s=time.perf_counter() - start, send_lag_s=lag,
                               expected_input_tokens=request.input_length,
                               expected_output_tokens=request.output_length)
        records.append(record)
        try:
            await sender.send(prompt(request) if text is None else text, max(1, request.output_length), record)
        finally:
            ends.append(time.perf_counter())
            progress.done(record)

    tasks: set[asyncio.Task[None]] = set()

    def spawn(coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    def expired() -> bool:
        return deadline is not None and time.perf_counter() >= deadline

    try:
        if config.mode == "open":
            for request in requests:
                # The prompt is built before its due time, while the loop would sleep anyway:
                # built at send time, a long uncached prompt holds the loop past the next
                # sends and every stream in flight (measured as TTFT and send lag).
                text = prompt(request)
                due = start + request.arrival_s / config.speedup
                delay = due - time.perf_counter()
                if delay > 0:
                    if deadline is not None and due >= deadline:
                        break
                    await asyncio.sleep(delay)
                if expired():
                    break
                spawn(one(request, max(0.0, time.perf_counter() - due), text))
        elif config.mode == "closed":
            queue = iter(requests)

            async def user() -> None:
                for request in queue:
                    if expired():
                        return
                    await one(request, None)

            for _ in range(config.concurrency):
                spawn(user())
        else:
            raise ValueError(f"unknown replay mode {config.mode!r}")
        if tasks:
            budget = config.drain_timeout_s + (max(0.0, deadline - time.perf_counter()) if deadline else 0.0)
            _, pending = await asyncio.wait(set(tasks), timeout=budget if deadline else None)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)
    finally:
        progress.close()
    wall = (max(ends) if ends else time.perf_counter()) - start
    records.sort(key=lambda r: r.index)
    return ReplayResult(records, wall, time.process_time() - cpu0, synthesis_cpu)
