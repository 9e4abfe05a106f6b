"""router/flow_share.py: routers that queue for one pool keep one fair share by exchanging reports."""

from __future__ import annotations

import json

import pytest

from deepinfer_gateway.router.flow import FlowLimits, FlowRequest, PoolLoad, PoolQueue, Tier, WorkerLoad
from deepinfer_gateway.router.flow_share import Report, Service, SharedShare, decode, encode

LIMITS = FlowLimits(max_queued_per_pool=1000, max_queued_per_tenant=1000)
BUSY = PoolLoad((WorkerLoad(0.5, 10_000.0, 0, 1, 0.1),))
IDLE = PoolLoad((WorkerLoad(0.0, 10_000.0, 0, 1, 0.1),))
STALE_S = 1.0


def request(tenant: str, tier: Tier = Tier.DEFAULT, tokens: int = 1000) -> FlowRequest:
    return FlowRequest(tenant, tier, tokens, tokens, 0.0, 1e9)


def router(shared: bool) -> PoolQueue:
    return PoolQueue(LIMITS, SharedShare(30.0, STALE_S) if shared else None)


def share_of(queue: PoolQueue) -> SharedShare:
    assert isinstance(queue.share, SharedShare)
    return queue.share


def exchange(routers: list[PoolQueue], now: float) -> None:
    """Each router's report as the others read it back (through the wire format)."""
    texts = [encode(share_of(q).report(q.queued_by_tenant(), now)) for q in routers]
    for i, queue in enumerate(routers):
        share_of(queue).heard([r for j, t in enumerate(texts) if j != i if (r := decode(t, now)) is not None])


def shares(shared: bool, starts: int = 400) -> dict[str, int]:
    """Router 0 holds tenants a and b, router 1 only a (both backlogged); one slot frees per step and
    the routers race for it (whichever looks first, alternating), exchanging every 5 steps."""
    routers = [router(shared), router(shared)]
    for _ in range(starts):
        routers[0].arrive(request("a"), BUSY, 0.0)
        routers[0].arrive(request("b"), BUSY, 0.0)
        routers[1].arrive(request("a"), BUSY, 0.0)
    started = {"a": 0, "b": 0}
    for step in range(starts):
        now = step * 0.01
        if step % 5 == 0 and shared:
            exchange(routers, now)
        for queue in routers if step % 2 else routers[::-1]:
            got = queue.next_start(IDLE, now)
            if got is not None:
                started[got.tenant] += 1
                break
    return started


def test_alone_each_router_shares_only_what_it_starts() -> None:
    started = shares(shared=False)
    assert started["b"] / sum(started.values()) == pytest.approx(0.25, abs=0.03)


def test_shared_the_tenants_split_the_pool_evenly_whichever_router_they_reach() -> None:
    started = shares(shared=True)
    assert sum(started.values()) == 400  # no slot is left idle by the yields
    assert started["b"] / 400 == pytest.approx(0.5, abs=0.03)


def test_a_higher_band_waiting_elsewhere_holds_back_this_routers_lower_band() -> None:
    here, there = router(True), router(True)
    here.arrive(request("batch", Tier.FLEX), BUSY, 0.0)
    there.arrive(request("chat", Tier.DEFAULT), BUSY, 0.0)
    exchange([here, there], 0.0)
    assert here.next_start(IDLE, 0.1) is None
    assert there.next_start(IDLE, 0.1) is not None
    # ... and an arriving flex request queues behind it rather than starting past it
    assert not here.arrive(request("batch2", Tier.FLEX), IDLE, 0.1).start
    exchange([here, there], 0.2)
    assert here.next_start(IDLE, 0.3) is not None


def test_a_stale_report_holds_nothing_back() -> None:
    here, there = router(True), router(True)
    here.arrive(request("batch", Tier.FLEX), BUSY, 0.0)
    there.arrive(request("chat", Tier.DEFAULT), BUSY, 0.0)
    exchange([here, there], 0.0)
    assert here.next_start(IDLE, 0.5) is None
    assert here.next_start(IDLE, STALE_S + 0.1) is not None  # the other router went silent


def test_a_trailing_tenant_elsewhere_is_let_through_only_past_the_picks_own_cost() -> None:
    here, there = router(True), router(True)
    here.arrive(request("a"), BUSY, 0.0)
    there.arrive(request("b"), BUSY, 0.0)
    share_of(here).served(request("a", tokens=600), 0.0)  # a is 600 ahead: within one request's cost (1000)
    exchange([here, there], 0.0)
    assert here.next_start(IDLE, 0.0) is not None
    here.arrive(request("a"), BUSY, 0.0)
    exchange([here, there], 0.0)  # a is now 1600 ahead of b, which waits there
    assert here.next_start(IDLE, 0.0) is None


def test_service_halves_every_half_life() -> None:
    service = Service(half_life_s=10.0)
    service.add((Tier.DEFAULT, "a"), 800.0, 0.0)
    assert service.value((Tier.DEFAULT, "a"), 10.0) == pytest.approx(400.0)
    assert service.value((Tier.DEFAULT, "a"), 30.0) == pytest.approx(100.0)
    assert service.current(200.0) == {}  # forgotten under a token's worth


def test_reports_round_trip() -> None:
    report = Report(5000.0, {(Tier.FLEX, "t1"): 3}, {(Tier.FLEX, "t1"): 120.0, (Tier.PRIORITY, "t2"): 7.5})
    assert decode(encode(report), at=48.0) == Report(48.0, report.queued, report.service)
    for damaged in ("", "{}", '[["x", "t", 1, 1]]', json.dumps([[9, "t", 1, 1]]), json.dumps([[1, "t", 1]])):
        assert decode(damaged, 0.0) is None
