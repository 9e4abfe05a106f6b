"""estimated_ttft's lockstep pricing (router/policies.py): a worker's DP ranks step together, so
a request waits for the largest chunk in its step and its own chunk holds the others there."""

from __future__ import annotations

import pytest

from deepinfer_gateway.config.policies import EstimatedTtftConfig
from deepinfer_gateway.router.policies import EstimatedTtft, _rank_load
from deepinfer_gateway.router.policy import Candidate, RoutingView

LOCKSTEP = EstimatedTtftConfig(lockstep=True)
RANK = 75_000.0  # one rank's prefill tokens/s: 4 ranks of a 300k/s instance
PER_TOKEN = 1 / RANK


def cand(wid: str, **kw: object) -> Candidate:
    return Candidate(worker_id=wid, hardware="sm100", pool="p", kv_format="f", dp_ranks=4,
                     prefill_tokens_per_s=4 * RANK, **kw)


def crowd(n: int, each: int, **kw: object) -> dict[str, object]:
    """`n` requests of `each` uncached tokens sent and not yet scheduled (booked in the queue too)."""
    return {"admitting": n, "admitting_tokens": n * each, "admitting_max": each,
            "queued_prefill_tokens": n * each, **kw}


def test_busiest_rank_holds_whole_chunks() -> None:
    assert _rank_load(0, 0, 0, 4) == 0
    assert _rank_load(3, 9_000, 5_000, 4) == 5_000  # one chunk a rank: the largest
    assert _rank_load(5, 30_000, 6_000, 4) == 12_000  # five on four ranks: one holds two


def test_a_cold_prompt_keeps_off_a_step_full_of_followers() -> None:
    """Nine followers of one prompt wait on `a` for their step, 600 uncached tokens each; a cold
    8,751-token prompt of another kind costs about the same anywhere on its own, but on `a` it
    would hold all nine for its prefill."""
    followers = cand("a", **crowd(9, 600))
    other = cand("b", queued_prefill_tokens=8_000)  # a cold prompt ahead, nobody waiting beside it
    view = RoutingView(8_751, (followers, other))
    unpriced = EstimatedTtft().choose(view)  # the default: off
    priced = EstimatedTtft(LOCKSTEP).choose(view)
    assert unpriced.worker_id == "a"  # a's queue is shorter
    assert priced.worker_id == "b"
    # On its own it would do better on `a` than the queue term says (the nine share its step,
    # its chunk the largest there): what moves it is the delay it would put on the nine.
    assert priced.costs["a"] == pytest.approx(8_751 * PER_TOKEN, abs=1e-6)
    assert priced.costs["a"] < unpriced.costs["a"]


def test_a_small_request_waits_for_the_largest_chunk_beside_it() -> None:
    heavy = cand("a", **crowd(1, 12_000))  # a 12k-token prefill will share its step
    view = RoutingView(1_000, (heavy, cand("b", queued_prefill_tokens=3_000)))
    decision = EstimatedTtft(LOCKSTEP).choose(view)
    assert decision.worker_id == "b"
    # queue wait for the others (none) + the busiest rank of its step: the 12k chunk
    assert decision.costs["a"] == pytest.approx(12_000 * PER_TOKEN, abs=1e-6)
    assert EstimatedTtft(EstimatedTtftConfig(lockstep=False)).choose(view).costs["a"] == pytest.approx(
        12_000 / (4 * RANK) + 1_000 * PER_TOKEN, abs=1e-6)


def test_chunks_count_up_to_a_ranks_step_budget() -> None:
    long = cand("a", **crowd(1, 100_000))
    decision = EstimatedTtft(EstimatedTtftConfig(lockstep=True, step_tokens=16_384)).choose(RoutingView(1_000, (long,)))
    assert decision.costs["a"] == pytest.approx(16_384 * PER_TOKEN, abs=1e-6)  # its first chunk, not all of it


def test_the_step_under_way_counts_what_is_left_of_it_when_asked() -> None:
    started = 10.0
    busy = cand("a", prefilling_max=7_500, prefilling_since=started)  # a 0.1 s step began at 10.0
    on = EstimatedTtft(EstimatedTtftConfig(lockstep=True, lockstep_under_way=True))
    fresh = on.choose(RoutingView(750, (busy,), now=started + 0.02)).costs["a"]
    later = on.choose(RoutingView(750, (busy,), now=started + 0.07)).costs["a"]
    assert fresh == pytest.approx(0.08 + 750 * PER_TOKEN, abs=1e-6)
    assert later == pytest.approx(0.03 + 750 * PER_TOKEN, abs=1e-6)
    assert EstimatedTtft(LOCKSTEP).choose(RoutingView(750, (busy,), now=started)).costs["a"] == pytest.approx(
        750 * PER_TOKEN, abs=1e-6)  # without lockstep_under_way: the queue term alone (empty here)
    chunked = cand("a", prefilling_max=50_000, prefilling_since=started)  # past one step: its next chunk's
    step = 16_384 * PER_TOKEN
    left = on.choose(RoutingView(750, (chunked,), now=started + step + 0.05)).costs["a"]
    assert left == pytest.approx(step - 0.05 + 750 * PER_TOKEN, abs=1e-6)
