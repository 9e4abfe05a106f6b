"""The engine seam: what a worker server needs from an engine (sim or DeepInfer).

A worker server (workers/server.py) exposes any `Engine` over worker protocols v1 and v2.
Events yielded by `generate` are the protocol's dicts (`protocol.ready_event`,
`tokens_event`, `finish_event`): exactly one `ready` first, any number of `tokens`,
exactly one `finish` last; a request refused before scheduling yields only a `finish`
with an error (docs/worker-protocol.md). Leaving the iterator early (client gone) must abort the
request inside the engine; `abort` does the same from another connection.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

from deepinfer_gateway.core.protocol import GenerateRequest, KvEventBatch, LoadReport, WorkerInfo


class Engine(Protocol):
    @property
    def info(self) -> WorkerInfo: ...

    async def start(self) -> None: ...

    async def stop(self) -> None:
        """Finish or abort in-flight requests (each gets a `finish` event) and release the engine."""

    def generate(self, request: GenerateRequest) -> AsyncIterator[dict[str, Any]]: ...

    async def abort(self, request_id: str) -> bool:
        """True when the request was in flight and is now aborted."""

    def load(self) -> LoadReport: ...

    def kv_events(self, after: int, limit: int = 10_000) -> KvEventBatch:
        """Events with seq > after, oldest first, at most `limit`."""

    async def wait_kv_events(self, after: int, timeout_s: float) -> None:
        """Return as soon as the event log's last seq differs from `after` (new events, or a
        cursor from another epoch), else after `timeout_s`; waits on a signal, never polls."""
