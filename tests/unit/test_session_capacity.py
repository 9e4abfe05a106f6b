"""router/session_capacity.py: live sessions within each worker's cache, waiting rounds first
come first served (pinned to their context's worker, or unpinned: on whichever worker has room
first), the TTL after a round and the bounded wait."""

from __future__ import annotations

from deepinfer_gateway.config import SessionCapacitySettings
from deepinfer_gateway.gateway.serving.session_share_sync import decode_live, decode_waits, encode_live, encode_waits
from deepinfer_gateway.router.session_capacity import (
    ARRIVAL_SKEW_S,
    CapacityLimits,
    Placement,
    SessionCapacity,
    Start,
    Verdict,
    Waiter,
    blocks_of,
    external_use,
    external_waits,
)

LIMITS = CapacityLimits(ttl_s=2.0, headroom=0.0, max_wait_s=10.0, hold_share=0.5)
ONE = {"w": 100}
TWO = {"a": 100, "b": 100}


def test_limits_from_settings() -> None:
    limits = CapacityLimits.of(SessionCapacitySettings(ttl_ms=1500, headroom=0.2, max_wait_ms=250, hold_share=0.4))
    assert limits == CapacityLimits(ttl_s=1.5, headroom=0.2, max_wait_s=0.25, hold_share=0.4)
    assert blocks_of(1) == 1 and blocks_of(128) == 1 and blocks_of(129) == 2


def test_a_session_that_fits_goes_and_a_live_one_always_goes_on() -> None:
    policy = SessionCapacity(LIMITS)
    assert policy.place("s1", 60, ONE, {}, 0.0) == Placement(Verdict.GO, avoid=frozenset())
    policy.begin("s1", "w", 60, 0.0)
    # a second session's context would not fit beside it: no room anywhere, so it waits (unpinned)
    assert policy.place("s2", 60, ONE, {}, 0.1) == Placement(Verdict.WAIT, candidates=frozenset(ONE))
    # s1's next round, however grown, goes on: its context is counted already
    policy.end("s1", 1.0)
    assert policy.place("s1", 90, ONE, {"w": 60}, 1.5) == Placement(Verdict.GO, "w")


def test_the_ttl_after_a_round_keeps_a_session_live_then_frees_its_room() -> None:
    policy = SessionCapacity(LIMITS)
    policy.begin("s1", "w", 60, 0.0)
    policy.end("s1", 1.0)
    assert policy.where("s1", 2.9) == "w" and policy.used("w", 2.9) == 60
    assert policy.where("s1", 3.0) is None and policy.used("w", 3.0) == 0
    assert policy.live_sessions("w") == 0
    # a round in flight is never expired
    policy.begin("s2", "w", 10, 4.0)
    assert policy.where("s2", 1_000.0) == "w"


def test_a_held_context_waits_for_its_worker_and_an_uncached_one_goes_where_there_is_room() -> None:
    policy = SessionCapacity(LIMITS)
    policy.begin("s1", "a", 80, 0.0)
    # s2's context is cached on a (its last round went there and expired): it waits for a
    assert policy.place("s2", 40, TWO, {"a": 30}, 0.0) == Placement(Verdict.WAIT, "a")
    # cached under hold_share: it goes anywhere but a, the worker without room
    assert policy.place("s3", 40, TWO, {"a": 10}, 0.0) == Placement(Verdict.GO, avoid=frozenset({"a"}))
    # held by b, which has room: it goes there
    assert policy.place("s4", 40, TWO, {"b": 40}, 0.0) == Placement(Verdict.GO, "b")


def test_a_prefix_cached_on_several_workers_holds_the_round_to_none_of_them() -> None:
    three = {"a": 100, "b": 100, "c": 100}
    policy = SessionCapacity(LIMITS)
    policy.begin("s1", "a", 80, 0.0)
    # 30 of 40 blocks cached on a and b alike (a shared system prompt): not pinned to a, the
    # ties' pick, but on to b, the other with room; c, which caches none of it, is left out
    shared = {"a": 30, "b": 30}
    assert policy.place("s2", 40, three, shared, 0.0) == Placement(Verdict.GO, avoid=frozenset({"a", "c"}))
    # b caches less than a, but within hold_share of the prompt (20 of 40 blocks): still alike
    assert policy.place("s2", 40, three, {"a": 30, "b": 12}, 0.0) == Placement(Verdict.GO,
                                                                                  avoid=frozenset({"a", "c"}))
    # a's own context (30 blocks more than b's): pinned to a, as before
    assert policy.place("s2", 40, three, {"a": 35, "b": 5}, 0.0) == Placement(Verdict.WAIT, "a")
    # both holders full: it waits for the first of them to have room, not for a alone
    policy.begin("s3", "b", 80, 0.0)
    assert policy.place("s4", 40, three, shared, 0.0) == Placement(Verdict.WAIT, candidates=frozenset({"a", "b"}))
    waiter = unpinned("s4", 40, 0.0, frozenset({"a", "b"}))
    policy.wait(waiter)
    policy.end("s3", 0.5)
    assert policy.starts_floating(three, 2.5) == [Start(waiter, False, "b")]


def unpinned(session: str, blocks: int, arrival: float, candidates: frozenset[str] = frozenset(TWO)) -> Waiter:
    return Waiter(session, blocks, None, arrival, candidates=candidates)


def test_an_unpinned_round_starts_on_whichever_worker_frees_room_first() -> None:
    policy = SessionCapacity(LIMITS)
    policy.begin("s1", "a", 80, 0.0)
    policy.begin("s2", "b", 90, 0.0)  # b has less room, and frees it first
    # no room anywhere: unpinned
    assert policy.place("s3", 40, TWO, {}, 0.0) == Placement(Verdict.WAIT, candidates=frozenset(TWO))
    waiter = unpinned("s3", 40, 0.0)
    policy.wait(waiter)
    assert waiter.pinned is False and sorted(policy.floating_workers()) == ["a", "b"]
    assert policy.waiting_workers() == [] and policy.any_waiting()
    assert policy.starts_floating(TWO, 0.5) == []
    policy.end("s2", 1.0)
    assert policy.starts_floating(TWO, 2.9) == []  # s2's TTL runs until 3.0
    assert policy.starts_floating(TWO, 3.0) == [Start(waiter, False, "b")]
    assert policy.where("s3", 3.0) == "b" and policy.used("b", 3.0) == 40
    assert not waiter.queued and not policy.any_waiting() and policy.floating_workers() == []
    assert policy.next_change(3.0) is None


def test_an_unpinned_round_takes_the_candidate_with_the_most_free_room() -> None:
    policy = SessionCapacity(LIMITS)
    three = {"a": 100, "b": 100, "c": 100}
    for session, worker, blocks in (("s1", "a", 90), ("s2", "b", 90), ("s3", "c", 95)):
        policy.begin(session, worker, blocks, 0.0)
    waiter = unpinned("new", 20, 0.0, frozenset(three))
    policy.wait(waiter)
    policy.end("s2", 0.0)  # b frees all of its room at 2.0
    policy.end("s3", 0.0)  # ... and c too
    policy.begin("s4", "b", 60, 1.0)  # b: 40 free from 2.0; c: 100
    assert [s.worker for s in policy.starts_floating(three, 2.0)] == ["c"]
    # ties by name; a worker of unknown capacity (0) has the most
    tie = SessionCapacity(LIMITS)
    tie.wait(unpinned("x", 10, 0.0))
    tie.wait(unpinned("y", 10, 0.0))
    assert [s.worker for s in tie.starts_floating(TWO, 0.0)] == ["a", "b"]  # then b has more room
    tie.wait(unpinned("z", 10, 0.0))
    assert [s.worker for s in tie.starts_floating({"a": 100, "b": 0}, 0.0)] == ["b"]


def test_a_pinned_round_still_waits_for_its_holder_and_has_it_first() -> None:
    policy = SessionCapacity(LIMITS)
    policy.begin("s1", "a", 80, 0.0)
    policy.begin("s2", "b", 80, 0.0)
    # s3's context is cached on a: it waits for a, though b may free room first
    assert policy.place("s3", 40, TWO, {"a": 30}, 0.0) == Placement(Verdict.WAIT, "a")
    pinned = Waiter("s3", 40, "a", 0.0)
    policy.wait(pinned)
    floating = unpinned("s4", 30, 0.1)
    policy.wait(floating)
    policy.end("s1", 0.2)
    policy.end("s2", 0.2)
    assert policy.starts_floating(TWO, 1.0) == [] and policy.starts("b", 100, 1.0) == []
    # both TTLs run out at 2.2: the unpinned round would take a (ties by name), but a's pinned line waits
    assert policy.starts_floating(TWO, 2.2) == [Start(floating, False, "b")]
    assert policy.starts("a", 100, 2.2) == [Start(pinned, False, "a")]
    assert pinned.pinned and policy.where("s3", 2.2) == "a"


def test_unpinned_rounds_start_in_arrival_order_and_none_overtakes_the_head() -> None:
    policy = SessionCapacity(LIMITS)
    policy.begin("live-a", "a", 70, 0.0)
    policy.begin("live-b", "b", 70, 0.0)
    big, small = unpinned("big", 50, 0.1), unpinned("small", 10, 0.2)
    other_pool = unpinned("elsewhere", 10, 0.3, frozenset({"c"}))
    policy.wait(big)
    policy.wait(small)
    policy.wait(other_pool)
    # small would fit beside either live session, but big came first; another pool's round goes on
    assert policy.starts_floating({**TWO, "c": 100}, 0.5) == [Start(other_pool, False, "c")]
    # a newcomer that would fit joins the line too, rather than overtaking it
    assert policy.place("newcomer", 5, TWO, {}, 0.5) == Placement(Verdict.WAIT, candidates=frozenset(TWO))
    policy.end("live-b", 1.0)
    started = policy.starts_floating(TWO, 3.0)  # live-b's TTL ran out: big on b, then small where most room is
    assert started == [Start(big, False, "b"), Start(small, False, "b")]
    assert policy.used("b", 3.0) == 60 and policy.used("a", 3.0) == 70


def test_an_unpinned_round_past_max_wait_starts_on_its_least_used_candidate() -> None:
    policy = SessionCapacity(LIMITS)
    policy.begin("s1", "a", 90, 0.0)
    policy.begin("s2", "b", 80, 0.0)
    waiter = unpinned("late", 50, 1.0)
    policy.wait(waiter)
    assert policy.next_change(1.0) == 11.0
    assert policy.starts_floating(TWO, 10.9) == []
    assert policy.starts_floating(TWO, 11.0) == [Start(waiter, True, "b")]
    assert policy.used("b", 11.0) == 130  # over capacity, as counted
    assert policy.next_change(11.0) is None


def test_next_change_counts_the_unpinned_line_and_a_leaver_leaves_it() -> None:
    policy = SessionCapacity(LIMITS)
    policy.begin("s1", "a", 90, 0.0)
    policy.begin("s2", "b", 90, 0.0)
    policy.wait(Waiter("pinned", 50, "a", 5.0))
    gone, kept = unpinned("gone", 50, 1.0), unpinned("kept", 50, 2.0)
    policy.wait(gone)
    policy.wait(kept)
    assert policy.next_change(5.0) == 11.0  # the unpinned head's wait runs out first
    assert policy.remove(gone) and not policy.remove(gone)
    assert policy.next_change(5.0) == 12.0
    policy.end("s2", 5.0)
    assert policy.next_change(5.0) == 7.0  # s2's TTL
    assert policy.remove(kept) and policy.floating_workers() == []
    assert policy.next_change(5.0) == 7.0 and policy.any_waiting()  # the pinned one still waits


def test_an_unpinned_round_of_a_session_live_on_a_candidate_starts_there() -> None:
    policy = SessionCapacity(LIMITS)
    policy.begin("s1", "a", 90, 0.0)
    policy.begin("s2", "b", 90, 0.0)
    waiter = unpinned("s2", 95, 0.0)  # s2's second round, sent before its first was placed
    policy.wait(waiter)
    assert policy.starts_floating(TWO, 0.1) == [Start(waiter, False, "b")]


def test_waiting_rounds_start_in_arrival_order_and_none_overtakes_the_head() -> None:
    policy = SessionCapacity(LIMITS)
    policy.begin("live", "w", 70, 0.0)
    big, small = Waiter("big", 50, "w", 0.1), Waiter("small", 10, "w", 0.2)
    policy.wait(big)
    policy.wait(small)
    # small would fit beside the live session, but big came first: nothing starts
    assert policy.starts("w", 100, 0.5) == []
    # a newcomer that would fit joins a line too, rather than overtaking it
    assert policy.place("newcomer", 5, ONE, {}, 0.5) == Placement(Verdict.WAIT, candidates=frozenset(ONE))
    policy.end("live", 1.0)
    assert policy.starts("w", 100, 2.9) == []  # the live session's TTL runs until 3.0
    started = policy.starts("w", 100, 3.0)
    assert [(s.waiter.session, s.timed_out) for s in started] == [("big", False), ("small", False)]
    assert not big.queued and policy.where("big", 3.0) == "w" and policy.used("w", 3.0) == 60
    assert policy.waiting_workers() == []


def test_no_session_starves_behind_rounds_that_keep_arriving() -> None:
    policy = SessionCapacity(LIMITS)
    policy.begin("live", "w", 60, 0.0)
    starved = Waiter("old", 60, "w", 0.0)
    policy.wait(starved)
    t = 0.0
    for i in range(5):  # newcomers keep arriving; each joins the line behind the old one
        t += 0.5
        placement = policy.place(f"new{i}", 10, ONE, {}, t)
        assert placement.verdict is Verdict.WAIT
        policy.wait(Waiter(f"new{i}", 10, "w", t))
    policy.end("live", t)
    started = [s.waiter.session for s in policy.starts("w", 100, t + LIMITS.ttl_s)]
    assert started[0] == "old"


def test_a_round_past_max_wait_starts_anyway_and_says_so() -> None:
    policy = SessionCapacity(LIMITS)
    policy.begin("live", "w", 90, 0.0)
    waiter = Waiter("late", 50, "w", 1.0)
    policy.wait(waiter)
    assert policy.next_change(1.0) == 11.0
    assert policy.starts("w", 100, 10.9) == []
    [start] = policy.starts("w", 100, 11.0)
    assert start.waiter is waiter and start.timed_out
    assert policy.used("w", 11.0) == 140  # over capacity, as counted
    assert policy.next_change(11.0) is None


def test_next_change_is_the_first_ttl_end_while_rounds_wait() -> None:
    policy = SessionCapacity(LIMITS)
    policy.begin("live", "w", 90, 0.0)
    policy.end("live", 0.5)
    policy.wait(Waiter("next", 50, "w", 0.6))
    assert policy.next_change(0.6) == 2.5


def test_a_client_that_leaves_leaves_the_line() -> None:
    policy = SessionCapacity(LIMITS)
    policy.begin("live", "w", 90, 0.0)
    gone, kept = Waiter("gone", 50, "w", 0.0), Waiter("kept", 5, "w", 0.1)
    policy.wait(gone)
    policy.wait(kept)
    assert policy.remove(gone) and not policy.remove(gone)
    assert [s.waiter.session for s in policy.starts("w", 100, 0.2)] == ["kept"]


def test_unknown_capacity_and_an_empty_worker_never_make_a_round_wait() -> None:
    policy = SessionCapacity(LIMITS)
    policy.begin("s1", "w", 500, 0.0)
    assert policy.place("s2", 500, {"w": 0}, {"w": 500}, 0.0) == Placement(Verdict.GO, "w")
    # a context larger than the whole cache still goes to a worker with nothing live
    assert policy.place("s3", 500, {"w": 100, "x": 100}, {}, 0.0) == Placement(Verdict.GO, avoid=frozenset({"w"}))


def test_a_session_moved_by_its_plan_counts_on_its_new_worker() -> None:
    policy = SessionCapacity(LIMITS)
    policy.begin("s1", "a", 40, 0.0)
    policy.move("s1", "b", 0.1)
    assert policy.where("s1", 0.1) == "b"
    assert policy.used("a", 0.1) == 0 and policy.used("b", 0.1) == 40
    policy.begin("s1", "a", 50, 0.2)  # a second round in flight, back on a
    assert policy.used("a", 0.2) == 50 and policy.used("b", 0.2) == 0
    policy.end("s1", 0.3)  # one still in flight: no TTL yet
    assert policy.where("s1", 5.0) == "a"
    policy.end("s1", 5.0)
    policy.end("s1", 5.1)  # none in flight: a no-op
    assert policy.where("s1", 6.9) == "a" and policy.where("s1", 7.0) is None


def test_headroom_keeps_part_of_the_cache_free() -> None:
    policy = SessionCapacity(CapacityLimits(headroom=0.2))
    policy.begin("s1", "w", 50, 0.0)
    assert policy.fits("w", 30, 100, 0.0)
    assert not policy.fits("w", 31, 100, 0.0)


def test_other_routers_live_sessions_count_against_a_workers_room_once_each() -> None:
    here, there, third = (SessionCapacity(LIMITS) for _ in range(3))
    there.begin("s1", "w", 60, 0.0)
    third.begin("s1", "w", 50, 0.0)  # the same session live on two other routers: counted once, its largest
    external = external_use([there.live_report(0.0), third.live_report(0.0)], here.sessions)
    assert external.used == {"w": 60} and external.sessions == {"s1": ("w", 60)}
    here.set_external(external)
    assert here.place("s2", 60, ONE, {}, 0.1) == Placement(Verdict.WAIT, candidates=frozenset(ONE))  # 60 + 60 > 100
    assert here.place("s3", 40, ONE, {}, 0.1) == Placement(Verdict.GO, avoid=frozenset())
    # s1's own round here goes on where it is live elsewhere, as a session live here does, even
    # past a round that waits there (its context is counted already, not twice)
    here.wait(Waiter("s2", 60, "w", 0.1))
    assert here.place("s1", 70, ONE, {"w": 60}, 0.2) == Placement(Verdict.GO, "w")
    # a session live here is this router's to count, whatever the others say
    here.begin("s1", "w", 70, 0.3)
    assert external_use([there.live_report(0.3)], here.sessions).used == {}


def test_live_reports_round_trip_and_damaged_ones_are_dropped() -> None:
    policy = SessionCapacity(LIMITS)
    policy.begin("s1", "a", 12, 0.0)
    policy.begin("s2", "b", 30, 0.0)
    live = policy.live_report(0.0)
    assert live == {"a": {"s1": 12}, "b": {"s2": 30}}
    assert decode_live(encode_live(live)) == live
    for damaged in ("", "{}", '[["a", "s1"]]', '[["a", "s1", "x"]]'):
        assert decode_live(damaged) is None


def test_rounds_waiting_at_other_routers_are_served_first_come_first_served() -> None:
    here, there = SessionCapacity(LIMITS), SessionCapacity(LIMITS)
    there.begin("s0", "a", 60, 0.0)
    here.set_external(external_use([there.live_report(0.0)], here.sessions))
    there.wait(Waiter("s1", 60, "a", 1.0))  # pinned to a, at the other router
    there.wait(Waiter("s2", 30, None, 2.0, candidates=frozenset(TWO)))  # unpinned, on a or b
    assert there.wait_report(3.0) == {"a": 2.0, "b": 1.0}  # each worker's oldest wait
    # written at 3.0 on the other router's clock, heard as written at 13.0 on this one's
    waits = external_waits([(13.0, there.wait_report(3.0))])
    assert waits == {"a": 11.0, "b": 12.0}
    here.set_external_waits(waits)
    # a newcomer takes neither worker: there is a round waiting for each
    assert here.place("s3", 10, TWO, {}, 13.1) == Placement(Verdict.WAIT, candidates=frozenset(TWO))
    assert here.place("s4", 10, TWO, {"b": 10}, 13.1) == Placement(Verdict.WAIT, "b")
    # a round waiting here that arrived before the other router's starts once it fits; one that
    # arrived after waits behind it, until its own wait runs out
    early = Waiter("s5", 10, "b", 11.0)
    late = Waiter("s6", 10, None, 12.5, candidates=frozenset({"b"}))
    here.wait(early)
    here.wait(late)
    assert here.starts("b", 100, 13.2) == [Start(early, False, "b")]
    assert here.starts_floating({"b": 100}, 13.2) == []
    assert here.starts_floating({"b": 100}, 22.5) == [Start(late, True, "b")]
    # arrivals within the clocks' skew count as together: both go, neither waits for the other
    again = Waiter("s7", 10, "a", 11.0 + ARRIVAL_SKEW_S / 2)
    here.wait(again)
    assert here.starts("a", 100, 23.0) == [Start(again, False, "a")]
    # once the other router's rounds have started, its reports hold no waits: newcomers go
    here.set_external_waits(external_waits([(24.0, {})]))
    assert here.place("s8", 10, TWO, {}, 24.0).verdict is Verdict.GO


def test_wait_reports_round_trip_and_damaged_ones_are_dropped() -> None:
    waits = {"a": 1.5, "b": 0.0}
    assert decode_waits(encode_waits(waits)) == waits
    for damaged in ("", "[]", '{"a": "x"}', '{"a": -1}', '{"a": NaN}'):
        assert decode_waits(damaged) is None
