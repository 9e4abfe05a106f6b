"""Sessions under cache pressure on the request path: a session's round waits here while its
worker's cache is full of other live sessions' contexts.

The policy is router/session_capacity.py's (pure); this module gives it a clock, the workers'
reported cache sizes (`memory_capacity_blocks`; a worker that reports none is not limited)
and waiters. `admit` decides before the round is planned (`Legs.first`): at once when the
session is live on a worker or fits where its context is cached, with the workers to leave out
when its context is cached nowhere; otherwise the round waits on a future that one pump task
resolves, woken when a round ends and at the policy's next change (a session's TTL ending, a
wait running out). A round pinned to its context's worker waits for that worker; one cached
nowhere waits for whichever worker of its pool has room first, and its pass then leaves the
pool's other workers out, so that its plan takes the worker it began on.
`SessionPass.placed` begins the round on the worker its plan chose; `ended`
starts the session's TTL when the round's exchange closes (or its first leg failed).
A client that disconnects while waiting leaves the line at once. With Redis, the routers that
share the workers count each other's live sessions (session_share_sync.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import Any

from deepinfer_gateway.config import SessionCapacitySettings
from deepinfer_gateway.gateway.fleet.registry import WorkerRegistry
from deepinfer_gateway.gateway.serving.session_share_sync import SessionShareSync
from deepinfer_gateway.gateway.telemetry.metrics import GatewayMetrics
from deepinfer_gateway.kvcache.types import Overlap
from deepinfer_gateway.router.session_capacity import (
    CapacityLimits,
    SessionCapacity,
    Start,
    Verdict,
    Waiter,
    blocks_of,
)
from deepinfer_gateway.router.worker_view import WorkerView

log = logging.getLogger(__name__)

MAX_SLEEP_S = 0.5  # the pump looks again at least this often while rounds wait (capacities change)


def reported_capacity(registry: WorkerRegistry) -> Callable[[str], int]:
    """worker id -> the KV blocks its last load report says its cache holds (0: unknown)."""
    def capacity(worker_id: str) -> int:
        worker = registry.workers.get(worker_id)
        load = worker.load if worker is not None else None
        return load.memory_capacity_blocks if load is not None else 0
    return capacity


class SessionPass:
    """A round's permission to be planned: `avoid`, workers the planner leaves out; `placed`
    once its plan chose a worker."""

    __slots__ = ("_gate", "request_id", "session", "blocks", "avoid", "waited_s", "_begun")

    def __init__(self, gate: SessionGate, request_id: str, session: str, blocks: int,
                 avoid: frozenset[str] = frozenset(), waited_s: float = 0.0, begun: bool = False) -> None:
        self._gate, self.request_id, self.session, self.blocks = gate, request_id, session, blocks
        self.avoid, self.waited_s, self._begun = avoid, waited_s, begun

    def placed(self, worker_id: str) -> None:
        """Its first leg's plan chose `worker_id`: the session is live there."""
        gate, now = self._gate, self._gate.now()
        if self._begun:
            gate.policy.move(self.session, worker_id, now)
        else:
            self._begun = True
            gate.policy.begin(self.session, worker_id, self.blocks, now)
            gate.rounds[self.request_id] = self.session
        gate.gauge(worker_id)


class SessionGate:
    """One per process: every worker's live sessions and the pump that starts waiting rounds."""

    def __init__(self, settings: SessionCapacitySettings, capacity_of: Callable[[str], int],
                 metrics: GatewayMetrics, redis: Any = None) -> None:
        """`redis`: the routers sharing it count each other's live sessions (`shared`)."""
        self.policy = SessionCapacity(CapacityLimits.of(settings))
        self.share = (SessionShareSync(redis, self.policy, settings.share_interval_ms / 1000.0,
                                       metrics.redis_errors.labels("sessions").inc, self._wake_pump)
                      if redis is not None and settings.shared else None)
        self._capacity_of = capacity_of
        self.metrics = metrics
        self.rounds: dict[str, str] = {}  # request id -> session, rounds begun and not ended
        self._wake = asyncio.Event()
        self._pump_task: asyncio.Task[None] | None = None

    @staticmethod
    def now() -> float:
        return asyncio.get_running_loop().time()

    async def admit(self, request_id: str, session: str, prompt_tokens: int, views: Sequence[WorkerView],
                    overlap: Overlap, pool: str) -> SessionPass:
        """Wait until `session`'s round (`prompt_tokens`) may be planned among `pool`'s workers."""
        blocks = blocks_of(prompt_tokens)
        capacities = {v.worker_id: self._capacity_of(v.worker_id) for v in views if v.pool == pool}
        if not any(capacities.values()):
            return SessionPass(self, request_id, session, blocks)  # no worker says what its cache holds
        if self.share is not None:
            await self.share.touched(self.now())
        now = self.now()
        memory = overlap.memory
        placement = self.policy.place(session, blocks, capacities, {w: memory.get(w, 0) for w in capacities}, now)
        if placement.verdict is Verdict.GO:
            return SessionPass(self, request_id, session, blocks, placement.avoid)
        future: asyncio.Future[Start] = asyncio.get_running_loop().create_future()
        waiter = Waiter(session, blocks, placement.worker, now, future,
                        candidates=placement.candidates)
        self.policy.wait(waiter)
        self.metrics.session_waits.labels(pool).inc()
        if self._pump_task is None:
            self._pump_task = asyncio.create_task(self._pump(), name="session-capacity")
        self._wake.set()
        try:
            start = await future
        except asyncio.CancelledError:
            if not self.policy.remove(waiter) and future.done() and not future.cancelled():
                self.policy.end(session, self.now())  # started, then its client left before it was planned
            raise
        self.rounds[request_id] = session
        waited = self.now() - now
        self.metrics.session_wait.labels(pool).observe(waited)
        if start.timed_out:
            self.metrics.session_proceeded.labels(pool).inc()
        # unpinned: it began on the worker that had room, which its plan then takes
        avoid = waiter.candidates - {start.worker}
        return SessionPass(self, request_id, session, blocks, avoid, waited_s=waited, begun=True)

    async def close(self) -> None:
        if self.share is not None:
            await self.share.close()

    def _wake_pump(self) -> None:
        """Look again at the waiting rounds (other routers' sessions may have ended)."""
        if self._pump_task is not None:
            self._wake.set()

    def ended(self, request_id: str) -> None:
        """The round's exchange closed, or its first leg failed: its session's TTL starts (a
        no-op for a round that never began)."""
        session = self.rounds.pop(request_id, None)
        if session is None:
            return
        worker = self.policy.where(session, self.now())
        self.policy.end(session, self.now())
        if worker is not None:
            self.gauge(worker)
        if self._pump_task is not None:
            self._wake.set()

    def ending(self, request_id: str, on_done: Callable[[int], None] | None) -> Callable[[int], None]:
        """`on_done` (an exchange's end) that first ends the round."""
        def done(completion_tokens: int) -> None:
            self.ended(request_id)
            if on_done is not None:
                on_done(completion_tokens)
        return done

    def gauge(self, worker: str) -> None:
        self.metrics.session_live.labels(worker).set(self.policy.live_sessions(worker))

    async def _pump(self) -> None:
        loop = asyncio.get_running_loop()
        policy = self.policy
        try:
            while policy.any_waiting():
                self._wake.clear()
                now = loop.time()
                for worker in policy.waiting_workers():  # pinned lines first: they have their workers first
                    self._resolve(policy.starts(worker, self._capacity_of(worker), now))
                    self.gauge(worker)  # its live sessions, TTLs run out included
                if floating := policy.floating_workers():
                    self._resolve(policy.starts_floating({w: self._capacity_of(w) for w in floating}, now))
                change = policy.next_change(now)
                if change is None:
                    continue
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), min(MAX_SLEEP_S, max(0.001, change - now)))
        except Exception:
            log.exception("session capacity pump failed; waiting rounds go on at once")
            now = loop.time()
            for worker in policy.waiting_workers():
                self._resolve(policy.starts(worker, 0, now))  # capacity 0: not limited
            self._resolve(policy.starts_floating(dict.fromkeys(policy.floating_workers(), 0), now))
        finally:
            self._pump_task = None

    def _resolve(self, starts: list[Start]) -> None:
        """Wake the started rounds' `admit`s."""
        for start in starts:
            future = start.waiter.handle
            if isinstance(future, asyncio.Future) and not future.done():
                future.set_result(start)
            self.gauge(start.worker)
