"""bench/chaos.py's load: the project's load generator (deepinfer_gateway/loadgen: openai SDK,
streaming, no client retries, open loop on the trace clock) sent to two gateway replicas
through a client-side spread that behaves as the shipped nginx upstream
(deploy/nginx/nginx.conf):

- least connections among the replicas not marked down (ties taken in turn);
- a connection that cannot be opened (the load generator's `connect` error) counts a
  failure against its replica (2 within 5 s: skipped for 5 s) and the request, which that
  replica never received, goes to the other (`proxy_next_upstream error`, 2 tries);
- a request that reached a replica is never sent again (nginx does not resend a POST), so
  one in flight on a replica that dies fails: the client sees a reset, an explicit failure.

The load runs until `stop` is set (at most the trace's length), then drains.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import overload

from _chaos_workload import SessionTrace

from deepinfer_gateway.loadgen.client import ClientConfig, ProtocolClient
from deepinfer_gateway.loadgen.replay import ReplayConfig, replay
from deepinfer_gateway.loadgen.run import detect_model
from deepinfer_gateway.workload.synthesis import PromptSynthesizer
from deepinfer_gateway.workload.types import RecordError, RequestRecord, TraceRequest


class Spread:
    """A `replay` sender over several replicas, nginx's way (module docstring)."""

    def __init__(self, clients: Sequence[ProtocolClient], max_fails: int = 2, fail_timeout_s: float = 5.0):
        self.clients = clients
        self.inflight = [0] * len(clients)
        self.fails: list[deque[float]] = [deque() for _ in clients]
        self.down_until = [0.0] * len(clients)
        self.max_fails, self.fail_timeout_s = max_fails, fail_timeout_s
        self.turn = 0
        self.resent = 0
        self.attempts = [0] * len(clients)

    def _pick(self, tried: list[int]) -> int | None:
        now = time.monotonic()
        candidates = [i for i in range(len(self.clients)) if i not in tried]
        up = [i for i in candidates if self.down_until[i] <= now] or candidates  # all down: try anyway
        if not up:
            return None
        self.turn += 1
        return min(up, key=lambda i: (self.inflight[i], (i - self.turn) % len(self.clients)))

    def _failed(self, i: int) -> None:
        now = time.monotonic()
        fails = self.fails[i]
        fails.append(now)
        while fails and fails[0] < now - self.fail_timeout_s:
            fails.popleft()
        if len(fails) >= self.max_fails:
            self.down_until[i] = now + self.fail_timeout_s
            fails.clear()

    async def send(self, prompt: str, max_tokens: int, record: RequestRecord) -> None:
        tried: list[int] = []
        while (i := self._pick(tried)) is not None:
            if tried:
                self.resent += 1
                record.status, record.error, record.detail, record.http_status = "ok", None, None, None
            tried.append(i)
            self.inflight[i] += 1
            self.attempts[i] += 1
            try:
                await self.clients[i].send(prompt, max_tokens, record)
            finally:
                self.inflight[i] -= 1
            if record.error != RecordError.CONNECT:  # answered, or failed once it had reached the replica
                return
            self._failed(i)


class UntilStopped(Sequence[TraceRequest]):
    """The trace, whose iteration (replay sends as it iterates) ends once `stop` is set."""

    def __init__(self, requests: Sequence[TraceRequest], stop: threading.Event):
        self.requests, self.stop = requests, stop

    def __len__(self) -> int:
        return len(self.requests)

    @overload
    def __getitem__(self, i: int) -> TraceRequest: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[TraceRequest]: ...
    def __getitem__(self, i: int | slice) -> TraceRequest | Sequence[TraceRequest]:
        return self.requests[i]

    def __iter__(self) -> Iterator[TraceRequest]:
        for request in self.requests:
            if self.stop.is_set():
                return
            yield request


@dataclass
class LoadRun:
    records: list[RequestRecord]  # the requests sent
    resent: int  # sent to the other replica after a refused connection
    attempts: list[int]  # per replica


def run_load(urls: list[str], key: str, st: SessionTrace, synthesizer: PromptSynthesizer, stop: threading.Event,
             started: Callable[[float], None], timeout_s: float = 60.0) -> LoadRun:
    """Blocks until the load is over: `started` gets the perf_counter of its start."""
    model = detect_model(urls[0], key)

    async def main() -> LoadRun:
        clients = [ProtocolClient(ClientConfig(url=u, model=model, api_key=key, max_connections=256,
                                               request_timeout_s=timeout_s)) for u in urls]
        spread = Spread(clients)
        requests = st.trace.requests
        try:
            started(time.perf_counter())
            result = await replay(UntilStopped(requests, stop), synthesizer.content, spread,
                                  ReplayConfig(mode="open", duration_s=requests[-1].arrival_s + 1,
                                               drain_timeout_s=timeout_s, progress=False))
        finally:
            for c in clients:
                await c.aclose()
        return LoadRun(result.records, spread.resent, spread.attempts)

    return asyncio.run(main())
