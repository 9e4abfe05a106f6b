"""What a worker pushes on a v2 connection that asked for it: its KV event log and its load.

A gateway that negotiated pushes (protocol.MUX_PUSH_SUBPROTOCOL) subscribes with ops
(docs/worker-protocol.md "Pushes") and then polls nothing over HTTP while the connection
is up. Both pushers wait on a signal, never on a timer, while nothing changes:

- `push_kv_events`: waits on the engine's event log past its cursor (the long poll's
  `wait_kv_events`), sends the batch, then waits at least `interval_s` before the next
  one, so a quiet spell's first event leaves at once and a busy engine sends one message
  per interval (the rest of a burst waits, as a long poll's next poll does).
- `push_load`: a report now, then one whenever it differs from the last sent or the
  connection has read a request since (`requests_read`: the gateway learns that the report
  counts it), sampled every `interval_s` while the worker has requests; an idle worker (nothing running or
  waiting, no request open on any connection) is sampled again only when a request
  arrives (`Activity`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from deepinfer_gateway.core.protocol import KvEventBatch, LoadReport
from deepinfer_gateway.workers.engine import Engine

# A cursor that never changes makes `wait_kv_events` wait this long per call: long, since
# the wait ends at the next event anyway; bounded so a wedged log costs one wake-up a minute.
_KV_WAIT_S = 60.0


class Activity:
    """Requests open on this worker (v1 calls and v2 requests alike) and a signal when one
    arrives: a worker's load changes only while it has some."""

    def __init__(self) -> None:
        self.open = 0
        self._arrived: asyncio.Event | None = None  # only while a pusher waits

    def begin(self) -> None:
        self.open += 1
        if self._arrived is not None:
            self._arrived.set()
            self._arrived = None

    def end(self) -> None:
        self.open -= 1

    async def arrival(self) -> None:
        if self._arrived is None:
            self._arrived = asyncio.Event()
        await self._arrived.wait()


async def push_kv_events(engine: Engine, after: int, limit: int, interval_s: float,
                         send: Callable[[KvEventBatch], None]) -> None:
    """Send the event log from `after` on, each batch continuing where the last ended. The
    first goes at once, empty or not: it carries the epoch, so a cursor from before a restart
    that happens to equal the new log's last seq is still seen to be another epoch's."""
    loop = asyncio.get_running_loop()
    cursor = after
    first = True
    while True:
        if not first:
            await engine.wait_kv_events(cursor, _KV_WAIT_S)
        batch = engine.kv_events(cursor, limit)
        if not first and not batch.events and batch.last_seq == cursor:
            continue  # the wait timed out
        first = False
        send(batch)
        # The gateway expects the next batch from here (a cursor of another epoch: its last seq).
        cursor = batch.events[-1].seq if batch.events else batch.last_seq
        sent = loop.time()
        await asyncio.sleep(max(0.0, sent + interval_s - loop.time()))


async def push_load(engine: Engine, activity: Activity, interval_s: float, requests_read: Callable[[], int],
                    send: Callable[[LoadReport], None]) -> None:
    """Send a report now and each time it changes (module doc)."""
    last: tuple[LoadReport, int] | None = None
    while True:
        report = engine.load()
        if (report, requests_read()) != last:
            last = report, requests_read()
            send(report)
        if not report.running and not report.waiting and not activity.open:
            await activity.arrival()
        await asyncio.sleep(interval_s)
