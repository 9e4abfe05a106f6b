"""Routing policies as pure functions of hand-built views, plus properties over random views."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer_gateway.config.policies import (
    POLICIES,
    EstimatedTtftConfig,
    PrefixApproxConfig,
    SessionAffinityConfig,
    parse_policy,
)
from deepinfer_gateway.router.policies import (
    CacheAware,
    EstimatedTtft,
    LeastLoad,
    PowerOfTwo,
    PrefixApprox,
    RoundRobin,
    SessionAffinity,
    estimated_ttft_s,
    make_policy,
)
from deepinfer_gateway.router.policy import Candidate, Lineage, Reason, RoutingView


def cand(wid: str, **kw: object) -> Candidate:
    return Candidate(worker_id=wid, hardware=str(kw.pop("hardware", "sm100")), pool="prefill", kv_format="f", **kw)


def test_round_robin_cycles() -> None:
    view = RoutingView(100, (cand("b"), cand("a"), cand("c")))
    rr = RoundRobin()
    chosen = []
    for _ in range(4):
        decision = rr.choose(view)
        assert rr.choose(view) == decision  # asking again is no turn: only a request sent is
        rr.observe(view, decision)
        chosen.append(decision.worker_id)
    assert chosen == ["a", "b", "c", "a"]


def test_least_load_prefers_short_queue() -> None:
    view = RoutingView(100, (cand("a", queued_prefill_tokens=5000), cand("b", queued_prefill_tokens=10)))
    assert LeastLoad().choose(view).worker_id == "b"


def test_estimated_ttft_formula() -> None:
    c = cand("a", queued_prefill_tokens=30_000, memory_hit_blocks=10, store_hit_blocks=20,
             prefill_tokens_per_s=100_000.0, kv_load_bytes_per_s=1e9, kv_bytes_per_token=1000.0)
    seconds, mem, store = estimated_ttft_s(c, RoutingView(4000, (c,)))
    assert (mem, store) == (1280, 1280)
    assert seconds == 0.3 + (4000 - 2560) / 100_000 + 1280 * 1000 / 1e9


def test_estimated_ttft_prefers_memory_hit_over_idle_cold_worker() -> None:
    hot = cand("hot", memory_hit_blocks=500, queued_prefill_tokens=8000)
    cold = cand("cold")
    decision = EstimatedTtft().choose(RoutingView(64_000, (hot, cold)))
    assert decision.worker_id == "hot" and decision.reason is Reason.PREFIX_HIT
    assert decision.predicted_memory_tokens == 64_000


def test_estimated_ttft_weighs_hardware_speed() -> None:
    fast = cand("fast", prefill_tokens_per_s=340_000.0)
    slow = cand("slow", hardware="ascend950", prefill_tokens_per_s=204_000.0)
    assert EstimatedTtft().choose(RoutingView(20_000, (slow, fast))).worker_id == "fast"


def test_estimated_ttft_store_hit_beats_recompute() -> None:
    a = cand("a", store_hit_blocks=400, queued_prefill_tokens=1000)
    b = cand("b")
    decision = EstimatedTtft().choose(RoutingView(51_200, (a, b)))
    assert decision.worker_id == "a" and decision.reason is Reason.STORE_HIT
    assert decision.predicted_store_tokens == 51_200


def test_guard_overrides_cache_on_a_swamped_worker() -> None:
    swamped = cand("s", memory_hit_blocks=1000, queued_prefill_tokens=2_000_000, prefill_tokens_per_s=1e9)
    idle = [cand(f"i{i}") for i in range(3)]
    decision = EstimatedTtft().choose(RoutingView(128_000, (swamped, *idle)))
    assert decision.worker_id != "s" and decision.reason is Reason.LOAD_FALLBACK


def test_prefix_approx_learns_from_its_own_routing() -> None:
    policy = PrefixApprox()
    view = RoutingView(1280, (cand("a"), cand("b", queued_prefill_tokens=5)), block_hashes=tuple(range(10)))
    first = policy.choose(view)
    policy.observe(view, first)
    # "a" becomes busier, but the prefix is remembered on it
    busier = RoutingView(1280, (cand("a", queued_prefill_tokens=100), cand("b")), block_hashes=tuple(range(10)))
    assert policy.choose(busier).worker_id == first.worker_id == "a"
    assert policy.choose(busier).reason is Reason.PREFIX_HIT


def test_prefix_approx_is_bounded() -> None:
    policy = PrefixApprox(PrefixApproxConfig(capacity=5))
    view = RoutingView(1280, (cand("a"),), block_hashes=tuple(range(10)))
    policy.observe(view, policy.choose(view))
    assert len(policy._where) == 5
    assert 0 in policy._where  # the prefix's first block is kept, its extensions evicted


def test_cache_aware_balances_when_imbalanced() -> None:
    view = RoutingView(1280, (cand("a", memory_hit_blocks=10, queued_prefill_tokens=500_000), cand("b")))
    assert CacheAware().choose(view).worker_id == "b"


def test_session_affinity_sticks_and_yields_to_load() -> None:
    policy = SessionAffinity(LeastLoad(), SessionAffinityConfig(enabled=True, max_queue_tokens=1000))
    view = RoutingView(100, (cand("a"), cand("b", queued_prefill_tokens=10)), session_key="u1")
    policy.observe(view, policy.choose(view))  # -> a
    later = RoutingView(100, (cand("a", queued_prefill_tokens=500), cand("b")), session_key="u1")
    assert policy.choose(later).worker_id == "a"
    assert policy.choose(later).reason is Reason.AFFINITY
    swamped = RoutingView(100, (cand("a", queued_prefill_tokens=5000), cand("b")), session_key="u1")
    assert policy.choose(swamped).worker_id == "b"


def test_a_subagents_first_request_goes_to_its_parents_worker_until_siblings_would_queue() -> None:
    """LeastLoad alone sends each request to the emptiest worker; lineage keeps a subagent's first
    request on its parent's (their shared prefix) while that queue is within the bound."""
    policy = SessionAffinity(LeastLoad(), SessionAffinityConfig(enabled=True, lineage_max_queue_tokens=1000))
    parent = RoutingView(100, (cand("a", queued_prefill_tokens=5), cand("b")), session_key="root")
    policy.observe(parent, policy.choose(parent))  # -> b
    busy_b = (cand("a"), cand("b", queued_prefill_tokens=600))
    child = RoutingView(100, busy_b, session_key="root/agent-1", lineage=Lineage(parent_key="root"))
    first = policy.choose(child)
    assert (first.worker_id, first.reason) == ("b", Reason.LINEAGE)
    policy.observe(child, first)
    # a parallel sibling: its first request would queue behind the others on b: spread
    queued = (cand("a"), cand("b", queued_prefill_tokens=1600))
    sibling = RoutingView(100, queued, session_key="root/agent-2", lineage=Lineage(parent_key="root"))
    assert policy.choose(sibling).worker_id == "a"
    # the first subagent's follow-up is its own session now: affinity, not lineage
    follow = RoutingView(100, busy_b, session_key="root/agent-1", lineage=Lineage(parent_key="root"))
    assert policy.choose(follow).reason is Reason.AFFINITY


def test_the_shared_stores_memory_wins_over_this_processs() -> None:
    """Another replica moved the session (or placed the parent): its shared record decides."""
    policy = SessionAffinity(LeastLoad(), SessionAffinityConfig(enabled=True))
    cands = (cand("a"), cand("b", queued_prefill_tokens=10), cand("c", queued_prefill_tokens=20))
    own = RoutingView(100, cands, session_key="s")
    policy.observe(own, policy.choose(own))  # this process remembers s -> a
    moved = RoutingView(100, cands, session_key="s", lineage=Lineage(shared=True, session_worker="c"))
    assert policy.choose(moved).worker_id == "c"
    forgotten = RoutingView(100, cands, session_key="s", lineage=Lineage(shared=True))  # expired in Redis
    assert policy.choose(forgotten).worker_id == "a"
    child = RoutingView(100, cands, session_key="s/x", lineage=Lineage("s", shared=True, parent_worker="b"))
    assert (policy.choose(child).worker_id, policy.choose(child).reason) == ("b", Reason.LINEAGE)


candidates = st.lists(
    st.builds(
        cand,
        st.text("abcdefgh", min_size=1, max_size=3),
        queued_prefill_tokens=st.integers(0, 2_000_000),
        running=st.integers(0, 256),
        memory_hit_blocks=st.integers(0, 1024),
        store_hit_blocks=st.integers(0, 1024),
        prefill_tokens_per_s=st.floats(1e4, 1e6),
    ),
    min_size=1, max_size=12, unique_by=lambda c: c.worker_id,
)


@settings(max_examples=200, deadline=None)
@given(candidates, st.integers(1, 131_072), st.sampled_from(sorted(POLICIES)))
def test_every_policy_chooses_a_candidate(cands: list[Candidate], prompt: int, name: str) -> None:
    policy = make_policy(name)
    view = RoutingView(prompt, tuple(cands), block_hashes=tuple(range(prompt // 128)))
    decision = policy.choose(view)
    policy.observe(view, decision)
    assert decision.worker_id in {c.worker_id for c in cands}


@settings(max_examples=200, deadline=None)
@given(candidates, st.integers(1, 131_072))
def test_estimated_ttft_guard_bounds_imbalance(cands: list[Candidate], prompt: int) -> None:
    policy = EstimatedTtft()
    decision = policy.choose(RoutingView(prompt, tuple(cands)))
    chosen = next(c for c in cands if c.worker_id == decision.worker_id)
    mean = sum(c.queued_prefill_tokens for c in cands) / len(cands)
    assert chosen.queued_prefill_tokens <= policy.guard_ratio * mean + policy.guard_tokens


def test_estimated_ttft_prices_own_prefill_on_one_dp_rank() -> None:
    c = cand("a", dp_ranks=4, prefill_tokens_per_s=400_000.0)
    seconds, _, _ = estimated_ttft_s(c, RoutingView(40_000, (c,)))
    assert seconds == 40_000 * 4 / 400_000.0


def test_estimated_ttft_sticks_to_the_history_holder_within_the_margin() -> None:
    holder = cand("holder", memory_hit_blocks=300, queued_prefill_tokens=60_000)
    idle = cand("idle")
    decision = EstimatedTtft().choose(RoutingView(40_000, (holder, idle)))
    assert decision.worker_id == "holder" and decision.reason is Reason.PREFIX_HIT


def test_estimated_ttft_leaves_the_holder_when_its_queue_costs_too_much() -> None:
    holder = cand("holder", memory_hit_blocks=10, queued_prefill_tokens=300_000)
    idle = cand("idle")
    decision = EstimatedTtft().choose(RoutingView(40_000, (holder, idle)))
    assert decision.worker_id == "idle" and decision.reason is Reason.QUEUE_OVER_CACHE


# ------------------------------------------------------------------------------ configuration

@pytest.mark.parametrize(("given", "kind"), [
    ("round_robin", RoundRobin), ("least_load", LeastLoad), ({"name": "power_of_two", "choices": 3}, PowerOfTwo),
    (PrefixApproxConfig(capacity=9), PrefixApprox), ({"name": "cache_aware"}, CacheAware),
    (EstimatedTtftConfig(stick_s=0.0), EstimatedTtft),
])
def test_make_policy_builds_the_variant_from_a_name_a_table_or_a_config(given: object, kind: type) -> None:
    policy = make_policy(given)
    assert type(policy) is kind and policy.name in POLICIES


def test_policy_parameters_reach_the_policy() -> None:
    holder = cand("holder", memory_hit_blocks=300, queued_prefill_tokens=60_000)
    view = RoutingView(40_000, (holder, cand("idle")))
    assert make_policy("estimated_ttft").choose(view).worker_id == "holder"  # within the default margin
    strict = make_policy({"name": "estimated_ttft", "stick_ratio": 1.0, "stick_s": 0.0})
    assert strict.choose(view).worker_id == "idle"  # no margin: the cheaper estimate wins
    partial = RoutingView(12_800, (cand("a", memory_hit_blocks=20), cand("b")))  # a holds 20% of the prompt
    assert make_policy("cache_aware").choose(partial).reason is Reason.PREFIX_HIT
    assert make_policy({"name": "cache_aware", "min_match": 0.5}).choose(partial).reason is Reason.LEAST_LOAD
    loads = RoutingView(100, tuple(cand(f"w{i}", queued_prefill_tokens=1000 * i) for i in range(6)))
    every = make_policy({"name": "power_of_two", "choices": 6})  # draws all: always the least loaded
    assert {every.choose(loads).worker_id for _ in range(20)} == {"w0"}


def test_session_affinity_wraps_only_when_enabled() -> None:
    assert type(make_policy("least_load", SessionAffinityConfig())) is LeastLoad
    sticky = make_policy("least_load", SessionAffinityConfig(enabled=True, max_queue_tokens=7))
    assert isinstance(sticky, SessionAffinity) and sticky.max_queue_tokens == 7 and sticky.name == "least_load"


@pytest.mark.parametrize(("given", "message"), [
    ("fastest", "unknown routing policy 'fastest'; choose one of cache_aware, estimated_ttft, "),
    ({"stick_ratio": 2.0}, "a policy table needs a name"),
    ({"name": "estimated_ttft", "stick_ratio": 0.5}, "stick_ratio: Input should be greater than or equal to 1"),
    ({"name": "round_robin", "seed": 1}, "seed: unknown parameter"),
])
def test_invalid_policy_configs_say_what_is_wrong(given: object, message: str) -> None:
    with pytest.raises(ValueError) as e:
        parse_policy(given)
    assert str(e.value).startswith(message)


@settings(max_examples=100, deadline=None)
@given(candidates, st.integers(1, 131_072), st.sampled_from(sorted(POLICIES)), st.booleans(), st.integers(1, 4))
def test_choose_changes_no_state(cands: list[Candidate], prompt: int, name: str, affinity: bool, asks: int) -> None:
    """The planner ranks fallbacks with `choose`: a policy asked any number of times in between
    decides every later request as one that was asked once (only `observe` changes it)."""
    config = SessionAffinityConfig(enabled=affinity)
    asked, once = make_policy(name, config), make_policy(name, config)
    view = RoutingView(prompt, tuple(cands), block_hashes=tuple(range(prompt // 128)), session_key="s")
    fewer = RoutingView(prompt, tuple(cands[1:]) or tuple(cands), block_hashes=view.block_hashes, session_key="s")
    for _ in range(3):
        decision = asked.choose(view)
        for _ in range(asks):
            assert asked.choose(view) == decision
            asked.choose(fewer)
        assert once.choose(view) == decision
        asked.observe(view, decision)
        once.observe(view, decision)
