"""router/flow.py: saturation, bands, fair share by tokens, deadlines and bounds."""

from __future__ import annotations

from deepinfer_gateway.core.protocol import Role
from deepinfer_gateway.router.flow import (
    FlowLimits,
    FlowPolicy,
    FlowRequest,
    PoolLoad,
    PoolQueue,
    RecentPeak,
    ShedReason,
    Tier,
    WorkerLoad,
    can_start_now,
    pool_load,
    resolve_tier,
)
from deepinfer_gateway.router.worker_view import WorkerView

LIMITS = FlowLimits(max_engine_wait_s=0.2, max_engine_waiting=4, kv_usage_limit=0.95,
                    max_queued_per_pool=8, max_queued_per_tenant=5)
IDLE = PoolLoad((WorkerLoad(0.0, 10_000.0, 0, 1, 0.1),))
BUSY = PoolLoad((WorkerLoad(0.5, 10_000.0, 0, 1, 0.1),))


def request(tenant: str = "a", tier: Tier = Tier.DEFAULT, tokens: int = 100, deadline: float = 100.0,
            arrival: float = 0.0, weight: float = 1.0) -> FlowRequest:
    return FlowRequest(tenant, tier, tokens, tokens, arrival, deadline, weight)


def view(queued: int = 0, waiting: int = 0, kv: float = 0.0, pool: str = "p", slots: int = 0,
         preempts: bool = False) -> WorkerView:
    return WorkerView(worker_id=f"w{queued}{waiting}{kv}", role=Role.UNIFIED, pool=pool, hardware="sm100",
                      kv_format="f", model="m", queued_prefill_tokens=queued, waiting=waiting, kv_usage=kv,
                      slots=slots, preempts=preempts)


def test_saturation_from_queue_wait_waiting_requests_and_kv_usage() -> None:
    speed = {"sm100": 10_000.0}
    assert pool_load([view()], "p", speed).can_start(LIMITS)
    assert not pool_load([view(queued=3_000)], "p", speed).can_start(LIMITS)  # 0.3 s of queue
    assert not pool_load([view(waiting=4)], "p", speed).can_start(LIMITS)
    assert not pool_load([view(kv=0.97)], "p", speed).can_start(LIMITS)
    # one worker that can start is enough; another pool's load is not this pool's
    assert pool_load([view(queued=3_000), view(), view(queued=9_000, pool="q")], "p", speed).can_start(LIMITS)
    # tokens placed but not yet booked count
    assert not pool_load([view()], "p", speed, granted_tokens=2_500).can_start(LIMITS)


def test_unsaturated_empty_queue_starts_at_once() -> None:
    queue = PoolQueue(LIMITS)
    assert queue.arrive(request(), IDLE, 0.0).start
    assert len(queue) == 0


def test_saturated_pool_queues_then_starts_by_band() -> None:
    queue = PoolQueue(LIMITS)
    flex, default, priority = request("f", Tier.FLEX), request("d", Tier.DEFAULT), request("p", Tier.PRIORITY)
    for r in (flex, default, priority):
        arrival = queue.arrive(r, BUSY, 0.0)
        assert not arrival.start and arrival.shed is None
    assert queue.next_start(BUSY, 0.0) is None  # still saturated: nothing starts
    assert [queue.next_start(IDLE, 1.0) for _ in range(3)] == [priority, default, flex]
    assert len(queue) == 0


def test_a_flooding_tenant_does_not_starve_another_in_its_band() -> None:
    queue = PoolQueue(LIMITS.__class__(max_queued_per_pool=100, max_queued_per_tenant=100))
    flood = [request("flood", tokens=1000) for _ in range(20)]
    for r in flood:
        queue.arrive(r, BUSY, 0.0)
    # The flood's first request starts; the other tenant, arriving later, goes next.
    assert queue.next_start(IDLE, 0.1) is flood[0]
    light = request("light", tokens=1000)
    queue.arrive(light, BUSY, 0.2)
    assert queue.next_start(IDLE, 0.3) is light


def test_fair_share_is_by_tokens_and_weight() -> None:
    queue = PoolQueue(FlowLimits(max_queued_per_pool=100, max_queued_per_tenant=100))
    big = [request("big", tokens=4000) for _ in range(3)]
    small = [request("small", tokens=1000) for _ in range(12)]
    heavy = [request("heavy", tokens=4000, weight=4.0) for _ in range(3)]
    for r in [*big, *small, *heavy]:
        queue.arrive(r, BUSY, 0.0)
    order = [queue.next_start(IDLE, 1.0) for _ in range(8)]
    tokens = {t: sum(r.prompt_tokens for r in order if r is not None and r.tenant == t) for t in ("big", "small")}
    # In the first 8 starts, "small" (1000-token requests) gets several for each of "big"'s,
    # and the weight-4 tenant all three of its own.
    assert sum(1 for r in order if r is not None and r.tenant == "small") >= 3
    assert tokens["big"] <= 2 * 4000
    assert sum(1 for r in order if r is not None and r.tenant == "heavy") == 3


def test_request_that_cannot_start_before_its_deadline_is_refused_on_arrival() -> None:
    queue = PoolQueue(LIMITS)
    # 2 s past the bound at 10k tokens/s: a 1 s deadline cannot be met
    slow = PoolLoad((WorkerLoad(2.2, 10_000.0, 0, 1, 0.1),))
    arrival = queue.arrive(request(deadline=1.0), slow, 0.0)
    assert arrival.shed is not None and arrival.shed.reason is ShedReason.DEADLINE
    assert arrival.shed.retry_after_s == 2
    # the backlog ahead counts: 30k tokens of priority work ahead of a default request
    queue.arrive(request("p", Tier.PRIORITY, tokens=30_000, deadline=100.0), BUSY, 0.0)
    late = queue.arrive(request("d", Tier.DEFAULT, deadline=2.0), BUSY, 0.0)
    assert late.shed is not None and late.shed.reason is ShedReason.DEADLINE and late.shed.retry_after_s >= 3
    # ... but not a flex backlog behind it
    behind = PoolQueue(LIMITS)
    behind.arrive(request("f", Tier.FLEX, tokens=30_000), BUSY, 0.0)
    assert behind.arrive(request("p2", Tier.PRIORITY, deadline=2.0), BUSY, 0.0).shed is None


def test_an_expired_request_is_starved_when_later_requests_of_other_tenants_started() -> None:
    queue = PoolQueue(FlowLimits(max_queued_per_pool=100, max_queued_per_tenant=100))
    light = [request("light", tokens=1000, deadline=1.0, arrival=0.0) for _ in range(3)]
    heavy = [request("heavy", tokens=1000, weight=100.0, arrival=0.1) for _ in range(3)]
    for r in light + heavy:
        queue.arrive(r, BUSY, r.arrival)
    # After light's first, the weight-100 tenant's later requests all go first (tags 0, 10, 20 < 1000).
    assert [queue.next_start(IDLE, 0.5) for _ in range(4)] == [light[0], *heavy]
    late = queue.expired(1.0)
    assert late == light[1:]
    assert [r.starved for r in late] == [True, False]  # only light's next one was passed over
    # A request that expires while nothing of another tenant started after it is not starved.
    alone = PoolQueue(LIMITS)
    first, second = request("a", deadline=1.0, arrival=0.0), request("b", deadline=5.0, arrival=0.2)
    alone.arrive(first, BUSY, 0.0)
    alone.arrive(second, BUSY, 0.2)
    assert alone.expired(1.0) == [first] and not first.starved


def test_queued_request_past_its_deadline_expires() -> None:
    queue = PoolQueue(LIMITS)
    early, later = request(deadline=1.0), request(deadline=5.0)
    queue.arrive(early, BUSY, 0.0)
    queue.arrive(later, BUSY, 0.0)
    assert queue.expired(0.5) == []
    assert queue.expired(1.0) == [early]
    assert len(queue) == 1 and queue.next_start(IDLE, 1.0) is later


def test_bounds_per_tenant_and_pool_shed_flex_first() -> None:
    queue = PoolQueue(LIMITS)  # 8 per pool, 5 per tenant
    for _ in range(5):
        assert queue.arrive(request("a", Tier.FLEX), BUSY, 0.0).shed is None
    tenant_full = queue.arrive(request("a", Tier.FLEX), BUSY, 0.0).shed
    assert tenant_full is not None and tenant_full.reason is ShedReason.TENANT_FULL
    for _ in range(3):
        assert queue.arrive(request("b", Tier.DEFAULT), BUSY, 0.0).shed is None
    assert len(queue) == 8
    # full: a default request displaces the newest flex one
    arrival = queue.arrive(request("c", Tier.DEFAULT), BUSY, 0.0)
    assert arrival.shed is None and len(arrival.displaced) == 1 and arrival.displaced[0].tier is Tier.FLEX
    # a flex request finds nothing below it: refused
    full = queue.arrive(request("d", Tier.FLEX), BUSY, 0.0).shed
    assert full is not None and full.reason is ShedReason.QUEUE_FULL
    assert queue.depth(Tier.FLEX) == 4 and queue.depth(Tier.DEFAULT) == 4


def test_removed_request_leaves_no_trace() -> None:
    queue = PoolQueue(LIMITS)
    gone, stays = request("a"), request("b")
    queue.arrive(gone, BUSY, 0.0)
    queue.arrive(stays, BUSY, 0.0)
    assert queue.remove(gone) and not queue.remove(gone)
    assert queue.per_tenant == {"b": 1}
    assert queue.next_start(IDLE, 0.0) is stays and queue.next_start(IDLE, 0.0) is None


def test_one_pass_starts_only_what_the_pool_can_take() -> None:
    policy = FlowPolicy(LIMITS)
    queue = policy.pool("p")
    for _ in range(4):
        queue.arrive(request(tokens=1000), BUSY, 0.0)
    # 0.1 s of queue on one worker at 10k tok/s: one 1000-token start brings it to 0.2 s, the bound
    started = policy.starts("p", PoolLoad((WorkerLoad(0.1, 10_000.0, 0, 1, 0.1),)), 0.0)
    assert len(started) == 1 and len(queue) == 3


def test_tier_resolution_never_exceeds_the_key() -> None:
    assert resolve_tier(None, Tier.DEFAULT) is Tier.DEFAULT
    assert resolve_tier("auto", Tier.PRIORITY) is Tier.PRIORITY
    assert resolve_tier("priority", Tier.DEFAULT) is Tier.DEFAULT
    assert resolve_tier("priority", Tier.PRIORITY) is Tier.PRIORITY
    assert resolve_tier("flex", Tier.PRIORITY) is Tier.FLEX
    assert resolve_tier("default", Tier.FLEX) is Tier.FLEX
    assert resolve_tier("standard_only", Tier.PRIORITY, protocol_anthropic=True) is Tier.DEFAULT


def test_flex_leaves_a_reserve_of_the_starting_bound_to_higher_tiers() -> None:
    limits = FlowLimits(max_engine_waiting=2, flex_reserve=1)
    one_starting = PoolLoad((WorkerLoad(0.0, 10_000.0, 0, 1, 0.1),), starting=1)
    assert one_starting.can_start(limits, Tier.DEFAULT) and not one_starting.can_start(limits, Tier.FLEX)
    queue = PoolQueue(limits)
    assert not queue.arrive(request("f", Tier.FLEX), one_starting, 0.0).start  # waits: only the reserve is left
    assert queue.arrive(request("d", Tier.DEFAULT), one_starting, 1.0).start  # nothing of its band or above waits
    assert queue.next_start(one_starting, 1.0) is None  # flex keeps waiting for a start to end
    assert queue.next_start(IDLE, 1.0).tier is Tier.FLEX
    # a pool whose bound is one request still starts flex (the reserve never takes it all)
    assert PoolLoad((WorkerLoad(0.0, 10_000.0, 0, 1, 0.1),)).can_start(FlowLimits(max_engine_waiting=1), Tier.FLEX)


def test_flex_holds_at_most_its_share_of_the_pools_slots() -> None:
    speed = {"sm100": 10_000.0}
    limits = FlowLimits(flex_max_share=0.75)
    pool = [view(slots=4), view(slots=4, pool="q"), view(queued=1, slots=4)]  # 8 slots in pool p: 6 for flex
    assert pool_load(pool, "p", speed, flex_holding=5).can_start(limits, Tier.FLEX)
    held = pool_load(pool, "p", speed, flex_holding=6)
    assert not held.can_start(limits, Tier.FLEX) and held.can_start(limits, Tier.DEFAULT)
    queue = PoolQueue(limits)
    assert not queue.arrive(request("f", Tier.FLEX), held, 0.0).start  # waits for a flex request to end
    assert queue.arrive(request("d"), held, 0.0).start  # the tiers above start at once
    assert queue.next_start(held, 1.0) is None
    assert queue.next_start(pool_load(pool, "p", speed, flex_holding=5), 1.0).tier is Tier.FLEX
    # starting flex in one pass counts each start against the share
    policy = FlowPolicy(limits)
    for i in range(3):
        policy.pool("p").arrive(request(f"f{i}", Tier.FLEX), held, 0.0)
    assert len(policy.starts("p", pool_load(pool, "p", speed, flex_holding=4), 1.0)) == 2
    # no cap where the slots are unknown (a worker that does not say them), or at a share of 1
    assert pool_load([view(slots=4), view(queued=1)], "p", speed, flex_holding=99).can_start(limits, Tier.FLEX)
    assert held.can_start(FlowLimits(), Tier.FLEX)
    # a pool too small for the share still lets one flex request run
    assert limits.flex_slots(1) == 1 and limits.flex_slots(0) is None


def test_flex_yields_the_tiers_above_their_recent_peak() -> None:
    speed = {"sm100": 10_000.0}
    limits = FlowLimits(flex_yield_window_s=10.0)
    pool = [view(slots=4), view(queued=1, slots=4)]  # 8 slots
    assert pool_load(pool, "p", speed, flex_holding=4, others_peak=3).can_start(limits, Tier.FLEX)
    assert not pool_load(pool, "p", speed, flex_holding=5, others_peak=3).can_start(limits, Tier.FLEX)
    assert pool_load(pool, "p", speed, flex_holding=7).can_start(limits, Tier.FLEX)  # the tiers above idle: all
    assert limits.flex_slots(8, 8) == 1  # flex always gets one
    assert FlowLimits(flex_max_share=0.5, flex_yield_window_s=10.0).flex_slots(8, 1) == 4  # the smaller cap


def test_where_the_engines_preempt_flex_fills_the_pool_and_the_tiers_above_see_only_their_own_load() -> None:
    speed = {"sm100": 10_000.0}
    limits = FlowLimits(max_engine_waiting=1, flex_max_share=0.5, flex_yield_window_s=10.0)
    # flex holds every slot, its requests fill the engine's queue and prefill backlog
    busy = [view(queued=5_000, waiting=3, kv=0.97, slots=4, preempts=True)]
    full = pool_load(busy, "p", speed, starting=1, flex_holding=4, others_peak=4)
    assert full.preempts and full.can_start(limits, Tier.DEFAULT) and full.can_start(limits, Tier.PRIORITY)
    assert not full.can_start(limits, Tier.FLEX)  # flex still waits for the engine's queue
    idle = pool_load([view(slots=4, preempts=True)], "p", speed, flex_holding=3, others_peak=3)
    assert idle.can_start(limits, Tier.FLEX)  # no share, no yield: the tiers above preempt it
    # what the tiers above wait for: their own starting requests and held slots
    assert not pool_load(busy, "p", speed, starting=1, starting_above=1).can_start(limits, Tier.DEFAULT)
    assert not pool_load(busy, "p", speed, held_above=4).can_start(limits, Tier.DEFAULT)
    assert pool_load(busy, "p", speed, held_above=3).placed(100, limits).held_above == 4
    # a pool with one worker that does not preempt keeps the caps
    mixed = pool_load([*busy, view(slots=4)], "p", speed, flex_holding=4, others_peak=4)
    assert not mixed.preempts and not mixed.can_start(limits, Tier.FLEX)
    assert Tier.PRIORITY.engine_priority == -1 and Tier.DEFAULT.engine_priority == 0 and Tier.FLEX.engine_priority == 1


def test_recent_peak_is_the_most_held_over_the_last_window() -> None:
    peak = RecentPeak(10.0)
    assert peak.peak(0.0) == 0
    for t in (1.0, 2.0, 3.0):
        peak.add(1, t)
    peak.add(-2, 4.0)
    assert peak.value == 1 and peak.peak(5.0) == 3
    assert peak.peak(15.0) == 3  # a window later the last window's peak still counts
    assert peak.peak(26.0) == 1  # two windows later only what is held now
    peak.add(-1, 27.0)
    assert peak.peak(27.0) == 1 and peak.peak(48.0) == 0


def test_the_cheap_unsaturated_check_agrees_with_the_pool_load() -> None:
    speed = {"sm100": 10_000.0}
    cases = [[view()], [view(queued=3_000)], [view(waiting=4)], [view(kv=0.97)], [view(queued=3_000), view()],
             [view(queued=1_500), view(queued=1_600, waiting=1)], [view(pool="q")], [view(slots=4)],
             [view(slots=2), view(queued=1, slots=2)], [view(queued=3_000, slots=2, preempts=True)],
             [view(waiting=4, preempts=True), view(queued=1, slots=2, preempts=True)],
             [view(slots=2, preempts=True), view(queued=1, slots=2)]]
    limits = FlowLimits(max_engine_wait_s=0.2, max_engine_waiting=2, flex_reserve=1, flex_max_share=0.75,
                        flex_yield_window_s=5.0)
    for views in cases:
        for granted, starting, above in ((0, 0, 0), (1_000, 0, 0), (0, 1, 1), (0, 2, 0), (0, 2, 2), (600, 3, 1)):
            for tier in Tier:
                for holding, peak, held in ((0, 0, 0), (1, 0, 0), (2, 0, 0), (1, 2, 2), (2, 3, 1), (0, 4, 4)):
                    full = pool_load(views, "p", speed, granted, starting, holding, peak, above, held)
                    expected = bool(full.workers) and full.can_start(limits, tier)
                    got = can_start_now(views, "p", speed, limits, granted, starting, tier, holding, peak, above, held)
                    assert got == expected, (views, granted, starting, above, tier, holding, peak, held)
