"""A request's booking follows what its worker's load reports say of it, so that a worker's
queue as the router sees it (report + bookings) is the prefill it has ahead, its cached
prefixes not counted (router/booking.py `Booking`), live and in the simulator alike."""

from __future__ import annotations

from deepinfer_gateway.core.protocol import KV_BLOCK_TOKENS, FinishReason, Role
from deepinfer_gateway.router.booking import amount
from deepinfer_gateway.simulate.cluster import SimWorker
from deepinfer_gateway.workers.sim.core import SimRequest
from deepinfer_gateway.workers.sim.profiles import load_profile


def test_booking_amount_through_a_requests_life() -> None:
    assert amount(10_000, 8_000, reported=False, ready=False) == 2_000  # sent: the prefill it adds
    # waiting, reported at its whole prompt: minus what is cached
    assert amount(10_000, 8_000, reported=True, ready=False) == -8_000
    assert amount(10_000, 8_000, reported=True, ready=True) is None  # scheduled: the report counts its prefill


def test_ready_before_any_report_keeps_the_uncached_part() -> None:
    booking = _worker().book("r", prompt=5_000, cached=9_999)  # a prediction past the prompt counts as the prompt
    booking.on_ready(0.0)
    assert booking.amount() == 0
    booking = _worker().book("r", prompt=5_000, cached=1_000)
    booking.on_ready(0.0)
    assert booking.amount() == 4_000  # the report in hand predates it: it still adds its prefill
    assert booking.worker.reserved == 4_000


def _worker() -> SimWorker:
    return SimWorker("w", Role.UNIFIED, "unified", load_profile("sm100"), "m", None, 1.0)


def test_a_follow_up_turn_counts_its_uncached_part_once() -> None:
    """A conversation's holder gets its next turn, 16 cached blocks + 4 new ones: the router's
    view of its queue is the 4 new blocks (plus the other request's prompt) before the next
    load report, with it and once the worker scheduled the turn."""
    worker = _worker()
    core = worker.core
    first = list(range(16 * KV_BLOCK_TOKENS))
    core.add_request(SimRequest("t1", first, [1], FinishReason.LENGTH))
    while core.has_work():
        core.step(0.0)  # the first turn ran: its blocks are cached
    worker.report()
    assert worker.view().queued_prefill_tokens == 0
    blocker = [7] * (3 * KV_BLOCK_TOKENS)  # keeps the turn waiting behind it
    core.add_request(SimRequest("other", blocker, [1], FinishReason.LENGTH))
    other = worker.book("other", len(blocker), 0)
    turn = first + list(range(10**5, 10**5 + 4 * KV_BLOCK_TOKENS))
    core.add_request(SimRequest("t2", turn, [1], FinishReason.LENGTH))
    t2 = worker.book("t2", len(turn), 16 * KV_BLOCK_TOKENS)
    ahead = len(blocker) + 4 * KV_BLOCK_TOKENS
    assert worker.view().queued_prefill_tokens == ahead  # not in a report yet: the bookings
    worker.report()  # the worker reports both prompts whole while they wait
    assert core.load_totals()[0] == len(blocker) + len(turn)
    assert worker.view().queued_prefill_tokens == ahead
    assert worker.view().booked_tokens == -16 * KV_BLOCK_TOKENS
    _, updates = core.step(0.0)  # both scheduled
    bookings = {"other": other, "t2": t2}
    for update in updates:
        if update.ready is not None:
            bookings[update.request_id].on_ready(0.0)
    assert worker.booked == {} and worker.reserved == 0
    worker.report()
    assert worker.view().queued_prefill_tokens == core.load_totals()[0]


def test_a_booking_lists_its_uncached_part_as_admitting_then_prefilling_until_its_first_token() -> None:
    worker = _worker()
    booking = worker.book("r", prompt=5_000, cached=1_024)
    assert worker.admitting == {"r": 3_976} and worker.prefilling == {}
    view = worker.view()
    assert (view.admitting, view.admitting_tokens, view.admitting_max) == (1, 3_976, 3_976)
    booking.on_ready(7.5)
    assert worker.admitting == {} and worker.prefilling == {"r": (3_976, 7.5)}
    assert (worker.view().prefilling_max, worker.view().prefilling_since) == (3_976, 7.5)
    booking.unqueue()  # its first token
    assert worker.admitting == {} and worker.prefilling == {}
    failed = worker.book("f", prompt=2_000)
    failed.end()  # refused before it was scheduled
    assert worker.admitting == {} and worker.view().admitting == 0


def test_a_report_that_counts_a_scheduled_request_keeps_it_in_the_step_under_way() -> None:
    """Once a load report counts a scheduled request, its reservation goes (the report holds what
    is left of its prefill), but the step it is in lasts until its first token."""
    worker = _worker()
    booking = worker.book("r", prompt=5_000)
    booking.on_report()
    booking.on_ready(2.0)
    assert worker.reserved == 0 and worker.prefilling == {"r": (5_000, 2.0)}
    assert worker.view().prefilling_max == 5_000
    booking.unqueue()  # its first token
    assert worker.prefilling == {}
