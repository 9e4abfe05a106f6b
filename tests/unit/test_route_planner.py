"""RoutePlanner on hand-built worker views: which mode (unified, pd, bypass) and which worker,
what it excludes, and that a changed load report changes the choice. Pure: no I/O."""

from __future__ import annotations

import pytest

from deepinfer_gateway.config import RouterSettings
from deepinfer_gateway.core.protocol import KV_BLOCK_TOKENS, Role
from deepinfer_gateway.kvcache.types import Overlap
from deepinfer_gateway.router.planner import NoCandidate, RoutePlanner, WorkerView
from deepinfer_gateway.router.policy import Lineage, Reason

MODEL = "DeepSeek-V4.1-Flash"
LONG = 40 * KV_BLOCK_TOKENS  # far more than pd_bypass_tokens uncached


def view(worker_id: str, role: Role = Role.UNIFIED, *, kv_format: str = "fp8", queued: int = 0,
         prefills: bool = True, pool: str = "") -> WorkerView:
    return WorkerView(worker_id=worker_id, role=role, pool=pool or str(role), hardware="sm100", kv_format=kv_format,
                      model=MODEL, queued_prefill_tokens=queued, prefills=prefills)


def planner(**settings: object) -> RoutePlanner:
    return RoutePlanner(RouterSettings(**{"policy": "least_load", "decode_policy": "least_load", **settings}))


def test_unified_takes_the_least_loaded_and_carries_the_predicted_hit() -> None:
    workers = [view("a", queued=500), view("b", queued=100), view("c", queued=300)]
    overlap = Overlap(memory={"b": 3}, store={"fp8": 5})
    plan = planner().plan_first(workers, LONG, {}, overlap)
    assert (plan.mode, plan.worker.worker_id, plan.decision.reason) == ("unified", "b", Reason.LEAST_LOAD)
    # memory: b's 3 blocks; store: what the shared store adds beyond them
    assert plan.decision.predicted_memory_tokens == 3 * KV_BLOCK_TOKENS
    assert plan.decision.predicted_store_tokens == 2 * KV_BLOCK_TOKENS
    assert [c.worker_id for c in plan.view.candidates] == ["a", "b", "c"]


def test_a_new_load_report_changes_the_choice() -> None:
    p = planner()
    assert p.plan_first([view("a", queued=0), view("b", queued=900)], LONG, {}, Overlap()).worker.worker_id == "a"
    assert p.plan_first([view("a", queued=900), view("b", queued=0)], LONG, {}, Overlap()).worker.worker_id == "b"


def test_pd_starts_on_a_prefill_worker_whose_kv_format_some_decode_worker_reads() -> None:
    workers = [view("p-fp8", Role.PREFILL, queued=900), view("p-int8", Role.PREFILL, kv_format="int8"),
               view("d", Role.DECODE), view("u", Role.UNIFIED)]
    plan = planner().plan_first(workers, LONG, {}, Overlap())
    assert (plan.mode, plan.worker.worker_id) == ("pd", "p-fp8")  # int8 has no decode worker to hand off to
    worker, decision = planner().plan_decode(workers, "fp8", LONG)
    assert worker.worker_id == decision.worker_id == "d"


def test_a_mostly_cached_prompt_bypasses_prefill_on_a_decode_worker_that_prefills() -> None:
    cached_blocks = LONG // KV_BLOCK_TOKENS - 1  # one block uncached: under pd_bypass_tokens
    workers = [view("p", Role.PREFILL), view("d-no", Role.DECODE, prefills=False), view("d-yes", Role.DECODE)]
    overlap = Overlap(memory={"d-no": cached_blocks, "d-yes": cached_blocks})
    plan = planner(pd_bypass_tokens=256).plan_first(workers, LONG, {}, overlap)
    assert (plan.mode, plan.worker.worker_id, plan.decision.reason) == ("bypass", "d-yes", Reason.BYPASS)
    assert planner(pd_bypass_tokens=0).plan_first(workers, LONG, {}, overlap).mode == "pd"


def test_excluded_workers_are_never_chosen_and_none_left_is_no_candidate() -> None:
    workers = [view("a"), view("b", queued=900)]
    assert planner().plan_first(workers, LONG, {}, Overlap(), exclude=frozenset({"a"})).worker.worker_id == "b"
    with pytest.raises(NoCandidate):
        planner().plan_first(workers, LONG, {}, Overlap(), exclude=frozenset({"a", "b"}))
    with pytest.raises(NoCandidate, match="int8"):
        planner().plan_decode([view("d", Role.DECODE)], "int8", LONG)


def test_the_largest_pool_of_a_role_serves() -> None:
    workers = [view("small", pool="edge"), view("big-1", pool="main", queued=50), view("big-2", pool="main")]
    plan = planner().plan_first(workers, LONG, {}, Overlap())
    assert plan.worker.worker_id == "big-2" and {c.pool for c in plan.view.candidates} == {"main"}


def test_reconfigure_switches_policies_and_refuses_an_unknown_one_unchanged() -> None:
    p = planner()
    p.reconfigure(policy="round_robin")
    assert p.describe()["policy"] == "round_robin"
    workers = [view("a"), view("b")]
    plans = [p.plan_first(workers, LONG, {}, Overlap()) for _ in range(2)]
    assert {plan.decision.reason for plan in plans} == {Reason.ROUND_ROBIN}
    assert {plan.worker.worker_id for plan in plans} == {"a", "b"}  # turns, where least_load would repeat
    with pytest.raises(ValueError, match="no_such_policy"):
        p.reconfigure(policy="no_such_policy")
    assert p.describe()["policy"] == "round_robin"


def test_a_ranked_plan_lists_fallbacks_and_the_policy_observes_the_pick_alone() -> None:
    """Fallbacks come from the same ranking, unobserved: round robin still takes turns, a
    session stays where it was sent, prefix_approx remembers the pick, not the last fallback."""
    workers = [view("a"), view("b"), view("c")]
    p = planner(policy="round_robin")
    plans = [p.plan_first(workers, LONG, {}, Overlap(), fallbacks=2) for _ in range(9)]
    assert [plan.worker.worker_id for plan in plans] == ["a", "b", "c"] * 3
    for plan in plans:
        listed = [plan.worker.worker_id, *(w.worker_id for w in plan.fallbacks)]
        assert sorted(listed) == ["a", "b", "c"]
    assert len(p.plan_first(workers, LONG, {}, Overlap(), fallbacks=5).fallbacks) == 2  # no more than there are

    sticky = planner(policy="round_robin", session_affinity=True)
    firsts = {sticky.plan_first(workers, LONG, {}, Overlap(), session_key="alice", fallbacks=2).worker.worker_id
              for _ in range(6)}
    assert firsts == {"a"}

    approx = planner(policy="prefix_approx")
    hashes = {"fp8": list(range(40))}
    first = approx.plan_first(workers, LONG, hashes, Overlap(), fallbacks=2)
    again = approx.plan_first(workers, LONG, hashes, Overlap(), fallbacks=2)
    assert again.worker.worker_id == first.worker.worker_id and again.decision.reason is Reason.PREFIX_HIT


def test_the_planner_takes_the_sessions_lineage_as_an_input() -> None:
    """What the shell read from the replicas' shared memory decides, in every mode: the parent's
    worker for a subagent's first request, the session's own afterwards, its fallbacks too."""
    workers = [view("a"), view("b"), view("c")]
    p = planner(policy="round_robin", session_affinity=True)
    child = p.plan_first(workers, LONG, {}, Overlap(), session_key="root/sub0", fallbacks=2,
                         lineage=Lineage("root", shared=True, parent_worker="c"))
    assert (child.worker.worker_id, child.decision.reason) == ("c", Reason.LINEAGE)
    assert "c" not in {w.worker_id for w in child.fallbacks}
    moved = p.plan_first(workers, LONG, {}, Overlap(), session_key="root/sub0",
                         lineage=Lineage("root", shared=True, session_worker="b", parent_worker="c"))
    assert moved.worker.worker_id == "b"  # (round-robin's own turn here: its reason stays round_robin)
    busy = [view("a"), view("b"), view("c", queued=1_000_000)]
    loaded = planner(session_affinity=True)  # least load: what the pool policy does past the bound
    spread = loaded.plan_first(busy, LONG, {}, Overlap(), session_key="root/sub1",
                               lineage=Lineage("root", shared=True, parent_worker="c"))
    assert spread.worker.worker_id != "c" and spread.decision.reason is Reason.LEAST_LOAD
