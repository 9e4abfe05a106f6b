"""gateway/serving/session_gate.py on the event loop: a round cached nowhere waits for whichever
worker of its pool frees room first and its pass then steers its plan there; a round whose
context is cached on a worker waits for that worker; a client that leaves leaves the line."""

from __future__ import annotations

import asyncio

import pytest

from deepinfer_gateway.config import SessionCapacitySettings
from deepinfer_gateway.core.protocol import KV_BLOCK_TOKENS, Role
from deepinfer_gateway.gateway.serving.session_gate import SessionGate, SessionPass
from deepinfer_gateway.gateway.telemetry.metrics import GatewayMetrics
from deepinfer_gateway.kvcache.types import Overlap
from deepinfer_gateway.router.worker_view import WorkerView

TTL_MS = 100
SETTINGS = SessionCapacitySettings(enabled=True, ttl_ms=TTL_MS, headroom=0.0, max_wait_ms=30_000)
VIEWS = [WorkerView(worker_id=w, role=Role.UNIFIED, pool="p", hardware="sm100", kv_format="f", model="m")
         for w in ("a", "b")]
NOWHERE = Overlap()


def gate() -> SessionGate:
    return SessionGate(SETTINGS, lambda worker_id: 100, GatewayMetrics())  # every cache: 100 blocks


async def admit(g: SessionGate, request_id: str, session: str, blocks: int, overlap: Overlap = NOWHERE
                ) -> SessionPass:
    return await g.admit(request_id, session, blocks * KV_BLOCK_TOKENS, VIEWS, overlap, "p")


async def two_full(g: SessionGate) -> None:
    """s1 live on a (80 of its 100 blocks), s2 on b (90): a third 40-block context fits on neither."""
    first = await admit(g, "r1", "s1", 80)
    assert first.avoid == frozenset() and first.waited_s == 0
    first.placed("a")
    second = await admit(g, "r2", "s2", 90)
    assert second.avoid == frozenset({"a"})  # a has no room for it
    second.placed("b")


def test_a_round_cached_nowhere_takes_the_first_worker_that_frees_room() -> None:
    async def run() -> None:
        g = gate()
        await two_full(g)
        waiting = asyncio.create_task(admit(g, "r3", "s3", 40))
        await asyncio.sleep(0.05)
        assert not waiting.done() and g.policy.floating_workers()
        g.ended("r2")  # b frees its room once s2's TTL has run out
        room = await asyncio.wait_for(waiting, 2.0)
        assert room.waited_s >= TTL_MS / 1000 * 0.8
        assert room.avoid == frozenset({"a"})  # its plan takes b, where it began
        assert g.policy.where("s3", g.now()) == "b" and g.rounds["r3"] == "s3"
        room.placed("b")  # a no-op move: it counts there already
        assert g.policy.used("b", g.now()) == 40 and g.policy.used("a", g.now()) == 80
        assert not g.policy.any_waiting()

    asyncio.run(run())


def test_a_round_cached_on_a_worker_waits_for_it_while_another_frees_room() -> None:
    async def run() -> None:
        g = gate()
        await two_full(g)
        held = Overlap(memory={"a": 30})  # s3's context: most of it in a's cache
        pinned = asyncio.create_task(admit(g, "r3", "s3", 40, held))
        await asyncio.sleep(0.01)
        g.ended("r2")
        await asyncio.sleep(TTL_MS / 1000 * 2)
        assert not pinned.done()  # b has room, but s3's context is on a
        g.ended("r1")
        room = await asyncio.wait_for(pinned, 2.0)
        assert room.avoid == frozenset() and g.policy.where("s3", g.now()) == "a"

    asyncio.run(run())


def test_a_client_that_leaves_leaves_the_unpinned_line() -> None:
    async def run() -> None:
        g = gate()
        await two_full(g)
        waiting = asyncio.create_task(admit(g, "r3", "s3", 40))
        await asyncio.sleep(0.05)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert not g.policy.any_waiting() and g.policy.floating_workers() == []
        assert g.policy.where("s3", g.now()) is None

    asyncio.run(run())
