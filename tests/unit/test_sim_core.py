"""The pure scheduler: cached prefixes shorten prefill, batching, aborts free capacity."""

from __future__ import annotations

from dataclasses import replace

import pytest

from deepinfer_gateway.core.protocol import FinishReason, KvEventKind, KvTier
from deepinfer_gateway.workers.sim.core import AdmissionError, RequestUpdate, SchedulerCore, SimRequest
from deepinfer_gateway.workers.sim.kv_events import SimKvEventLog
from deepinfer_gateway.workers.sim.kv_store import InMemoryKvStore
from deepinfer_gateway.workers.sim.profiles import load_profile
from deepinfer_gateway.workers.sim.step_model import decode_seconds, prefill_seconds

SM100 = load_profile("sm100")
# One token per decode step unless a test says otherwise: step-exact expectations.
ONE_RANK = replace(SM100, dp_ranks=1, gpus_per_instance=1, nextn=0)


def core(profile=ONE_RANK, store=None, time_scale=1.0) -> SchedulerCore:
    return SchedulerCore(profile, SimKvEventLog("w"), "m", store=store, time_scale=time_scale)


def req(rid: str, prompt: list[int], n_out: int = 3, **kw) -> SimRequest:
    return SimRequest(rid, prompt, list(range(500, 500 + n_out)), FinishReason.STOP, **kw)


def run(c: SchedulerCore, now: float = 0.0) -> tuple[float, dict[str, list[RequestUpdate]]]:
    """Step until idle; returns total time and every update per request."""
    total = 0.0
    seen: dict[str, list[RequestUpdate]] = {}
    while c.has_work():
        d, ups = c.step(now)
        total += d
        for u in ups:
            seen.setdefault(u.request_id, []).append(u)
    return total, seen


def test_request_streams_ready_tokens_finish() -> None:
    c = core()
    c.add_request(req("a", list(range(1000)), n_out=4))
    _, seen = run(c)
    ups = seen["a"]
    assert ups[0].ready == (0, 0)
    assert [t for u in ups for t in u.token_ids] == [500, 501, 502, 503]
    assert ups[-1].finish is FinishReason.STOP and ups[-1].num_output_tokens == 4
    assert c.kv_usage == 0


def test_cached_prefix_shortens_prefill() -> None:
    c = core()
    prompt = list(range(8000))
    c.add_request(req("a", prompt, n_out=1))
    cold, _ = run(c)
    c.add_request(req("b", prompt + [7, 8, 9], n_out=1))
    warm, seen = run(c)
    mem, store = seen["b"][0].ready  # type: ignore[misc]
    assert mem == 62 * 128 and store == 0  # all full blocks of the shared 8,000 tokens
    assert warm < cold / 10
    assert c.cached_tokens_total[KvTier.MEMORY] == mem


def test_store_hits_cost_bandwidth_and_emit_store_events() -> None:
    store = InMemoryKvStore()
    a, b = core(store=store), core(store=store)
    prompt = list(range(128 * 100 + 5))
    a.add_request(req("x", prompt, n_out=1, workload_class="agent"))
    run(a, now=1000.0)
    stored = [e for e in a.events.batch(0).events if e.tier is KvTier.STORE and e.kind is KvEventKind.STORED]
    assert stored and stored[0].expires_at == pytest.approx(1000 + 3 * 86400)
    b.add_request(req("y", prompt, n_out=1))
    d, ups = b.step(1001.0)
    assert ups[0].ready == (0, 100 * 128)
    load = 100 * 128 * 890 / SM100.store_read_bytes_per_s
    assert d == pytest.approx(load + prefill_seconds(ONE_RANK, 5))


def test_chunked_prefill_and_decode_batching() -> None:
    c = core()
    c.add_request(req("long", list(range(40000)), n_out=2))
    d1, ups = c.step(0)
    assert ups[0].token_ids == [] and d1 == pytest.approx(prefill_seconds(ONE_RANK, 16384))
    assert c.rank_loads()[0].queued_prefill_tokens == 40000 - 16384
    for i in range(4):
        c.add_request(req(f"s{i}", [i] * 100, n_out=5))
    run(c)
    # Four short requests decoding together take one batched step each, not four.
    c2 = core()
    for i in range(4):
        c2.add_request(req(f"t{i}", [i] * 10, n_out=3))
    c2.step(0)
    d, ups = c2.step(0)
    assert len(ups) == 4 and d == pytest.approx(decode_seconds(ONE_RANK, 4))


def test_time_scale_divides_durations() -> None:
    slow, fast = core(), core(time_scale=100.0)
    for c in (slow, fast):
        c.add_request(req("a", list(range(5000))))
    assert fast.step(0)[0] == pytest.approx(slow.step(0)[0] / 100)


def test_abort_frees_capacity_and_max_num_seqs() -> None:
    c = core(replace(ONE_RANK, max_num_seqs=1))
    c.add_request(req("a", [1] * 10, n_out=50))
    c.add_request(req("b", [2] * 10, n_out=50))
    c.step(0)
    loads = c.rank_loads()[0]
    assert (loads.running, loads.waiting) == (1, 1) and c.kv_usage > 0
    assert c.abort("a") and not c.abort("a")
    _, ups = c.step(0)
    assert ups[0].request_id == "b" and ups[0].ready is not None
    assert c.abort("b") and not c.has_work() and c.kv_usage == 0


def test_a_context_prefilled_again_after_its_eviction_is_counted() -> None:
    c = core(replace(ONE_RANK, memory_capacity_blocks=70))
    session = list(range(8000))  # 62 full blocks
    c.add_request(req("a", session, n_out=1))
    run(c)
    c.add_request(req("a2", session + [1], n_out=1))  # its next round, still cached
    run(c)
    assert c.evicted_recomputed_tokens_total == 0
    c.add_request(req("other", list(range(10**6, 10**6 + 8000)), n_out=1))  # evicts most of it
    run(c)
    c.add_request(req("a3", session + [1, 2], n_out=1))
    _, seen = run(c)
    mem, _ = seen["a3"][0].ready  # type: ignore[misc]
    assert c.evicted_recomputed_tokens_total == 62 * 128 - mem > 0


def test_memory_capacity_makes_requests_wait() -> None:
    c = core(replace(ONE_RANK, memory_capacity_blocks=3))
    c.add_request(req("a", [1] * 200, n_out=100))  # 3 blocks
    c.add_request(req("b", [2] * 200, n_out=100))
    c.step(0)
    assert c.rank_loads()[0].waiting == 1
    with pytest.raises(AdmissionError):
        c.add_request(req("c", [3] * 1000))


def test_prefill_role_hands_off_after_first_token() -> None:
    c = core()
    c.add_request(req("p", list(range(300)), n_out=10, stop_after_first=True))
    _, seen = run(c)
    last = seen["p"][-1]
    assert last.token_ids == [500] and last.handoff and last.finish is FinishReason.STOP


def test_decode_role_starts_with_transferred_kv() -> None:
    c = core()
    c.add_request(req("d", list(range(300)), n_out=3, kv_loaded_seconds=0.002))
    d, ups = c.step(0)
    # The transfer and the first decode iteration share the step.
    assert ups[0].ready == (0, 0) and ups[0].token_ids == [500]
    assert d == pytest.approx(0.002 + decode_seconds(ONE_RANK, 1))
    _, seen = run(c)
    assert [t for u in seen["d"] for t in u.token_ids] == [501, 502]


def test_dp_ranks_share_the_load() -> None:
    c = core(SM100)
    for i in range(8):
        c.add_request(req(f"r{i}", [i] * 50))
    assert [r.waiting for r in c.rank_loads()] == [2, 2, 2, 2]


def test_a_request_beside_a_prefill_on_another_rank_cannot_hit_what_that_step_computes() -> None:
    c = core(replace(SM100, nextn=0))
    prompt = list(range(4000))
    c.add_request(req("a", prompt, n_out=2))
    c.add_request(req("b", [*prompt, 1, 2, 3], n_out=2))  # the next rank, admitted in the same step
    _, first = c.step(0.0)
    assert {u.request_id: u.ready for u in first} == {"a": (0, 0), "b": (0, 0)}
    c.add_request(req("c", [*prompt, 4, 5], n_out=2))  # after that step: a's blocks are cached
    _, second = c.step(0.0)
    assert next(u.ready for u in second if u.request_id == "c") == (31 * 128, 0)


def test_a_long_prompts_finished_chunks_are_cached_before_its_last_chunk() -> None:
    c = core(replace(SM100, nextn=0))
    prompt = list(range(20_000))  # two chunks of the 16,384-token step budget
    c.add_request(req("long", prompt, n_out=2))
    c.step(0.0)
    c.add_request(req("next", [*prompt[:18_000], 7], n_out=2))  # admitted at the next step
    _, updates = c.step(0.0)
    assert next(u.ready for u in updates if u.request_id == "next") == (16_384, 0)  # the first chunk's 128 blocks


def _decode_sizes(profile, rid: str = "s", n_out: int = 400) -> list[int]:
    """Tokens per decode step of one request (the prefill's single first token left out)."""
    c = core(profile)
    c.add_request(SimRequest(rid, list(range(200)), list(range(1000, 1000 + n_out)), FinishReason.LENGTH))
    _, seen = run(c)
    ups = [u for u in seen[rid] if u.token_ids]
    assert [t for u in ups for t in u.token_ids] == list(range(1000, 1000 + n_out))  # in order, none lost
    assert len(ups[0].token_ids) == 1  # the step that completes prefill samples one token
    return [len(u.token_ids) for u in ups[1:-1]]  # the last step may be cut by the output's end


def test_default_profile_is_dsparks_published_sweep() -> None:
    assert (SM100.nextn, SM100.acceptance, SM100.decode_tokens_per_step) == (3, 0.75, 3.25)


def test_speculative_steps_draw_one_plus_accepted_drafts_per_request() -> None:
    dspark = replace(ONE_RANK, nextn=3, acceptance=0.75)
    sizes = _decode_sizes(dspark, n_out=4000)
    assert set(sizes) <= {1, 2, 3, 4} and len(set(sizes)) == 4  # 0..3 drafts accepted, each outcome seen
    assert sum(sizes) / len(sizes) == pytest.approx(3.25, abs=0.1)  # 1 + 3 x 0.75 (~1200 draws)
    assert _decode_sizes(dspark, n_out=4000) == sizes  # seeded: the same request draws the same steps
    assert _decode_sizes(dspark, "other", n_out=4000) != sizes  # ... by its own request id


def test_draws_of_a_request_do_not_depend_on_its_batch() -> None:
    """Each request draws from its own RNG: a neighbour in the batch changes nothing (the
    offline simulator's cruising relies on it, simulate/cruise.py)."""
    dspark = replace(ONE_RANK, nextn=3, acceptance=0.75)
    alone = _decode_sizes(dspark, "a")
    c = core(dspark)
    c.add_request(SimRequest("b", list(range(300, 500)), list(range(7, 300)), FinishReason.LENGTH))
    c.add_request(SimRequest("a", list(range(200)), list(range(1000, 1400)), FinishReason.LENGTH))
    _, seen = run(c)
    assert [len(u.token_ids) for u in seen["a"] if u.token_ids][1:-1] == alone


@pytest.mark.parametrize(("nextn", "acceptance", "size"), [(0, 0.75, 1), (3, 1.0, 4), (3, 0.0, 1), (5, 1.0, 6)])
def test_fixed_step_sizes_without_draws(nextn: int, acceptance: float, size: int) -> None:
    sizes = _decode_sizes(replace(ONE_RANK, nextn=nextn, acceptance=acceptance), n_out=100)
    assert sizes and set(sizes) == {size}


def test_decode_step_time_keeps_the_mean_per_user_speed() -> None:
    """The charts' per-user speed includes MTP: a step lasts its mean group's time."""
    assert decode_seconds(SM100, 8) == pytest.approx(3.25 * decode_seconds(replace(SM100, nextn=0), 8))


PRIORITY_2_SLOTS = replace(ONE_RANK, max_num_seqs=2, scheduling_policy="priority")


def _step_until(c: SchedulerCore, done: set[str], seen: dict[str, list[RequestUpdate]]) -> None:
    """Step until every request of `done` has finished, collecting updates."""
    while not done <= {rid for rid, ups in seen.items() if ups[-1].finish is not None}:
        _, ups = c.step(0.0)
        for u in ups:
            seen.setdefault(u.request_id, []).append(u)


def test_priority_scheduling_preempts_the_least_urgent_latest_request_and_resumes_it() -> None:
    c = core(PRIORITY_2_SLOTS)
    seen: dict[str, list[RequestUpdate]] = {}
    c.add_request(req("flex-old", list(range(300)), n_out=40, priority=1))
    c.add_request(req("flex-new", list(range(1000, 1300)), n_out=40, priority=1))
    for _ in range(5):  # both decode: every slot is taken
        _, ups = c.step(0.0)
        for u in ups:
            seen.setdefault(u.request_id, []).append(u)
    c.add_request(req("urgent", list(range(2000, 2300)), n_out=3, priority=-1))
    _step_until(c, {"urgent"}, seen)
    assert c.preemptions_total == 1
    # The latest of the least urgent made room; the older one kept decoding.
    assert len([t for u in seen["flex-old"] for t in u.token_ids]) > len(
        [t for u in seen["flex-new"] for t in u.token_ids])
    _step_until(c, {"flex-old", "flex-new"}, seen)
    for rid in ("flex-old", "flex-new"):  # the preempted one resumes where it stopped: no token lost or repeated
        assert [t for u in seen[rid] for t in u.token_ids] == list(range(500, 540))
        assert [u.ready for u in seen[rid] if u.ready is not None] == [(0, 0)]  # announced once
    assert c.kv_usage == 0 and not c.has_work()


def test_priority_orders_the_waiting_line_and_fcfs_never_preempts() -> None:
    c = core(PRIORITY_2_SLOTS)
    for i, priority in enumerate([0, 0, 1, 0, -1]):
        c.add_request(req(f"r{i}", list(range(i * 1000, i * 1000 + 300)), n_out=4, priority=priority))
    admitted: list[str] = []
    while c.has_work():
        _, ups = c.step(0.0)
        admitted += [u.request_id for u in ups if u.ready is not None]
    assert admitted == ["r4", "r0", "r1", "r3", "r2"]  # by (priority, arrival)
    assert c.preemptions_total == 0  # equal priorities never preempt each other

    fcfs = core(replace(PRIORITY_2_SLOTS, scheduling_policy="fcfs"))
    for i in range(2):
        fcfs.add_request(req(f"f{i}", list(range(i * 1000, i * 1000 + 300)), n_out=40, priority=1))
    fcfs.step(0.0)
    fcfs.add_request(req("u", list(range(5000, 5300)), n_out=3, priority=-1))
    run(fcfs)
    assert fcfs.preemptions_total == 0


def test_priority_scheduling_prefills_the_most_urgent_first() -> None:
    """A long flex prompt is mid-prefill when an urgent request arrives: the urgent one takes the
    step's prefill budget first (under fcfs it waits for the flex prompt's chunks)."""
    def first_token_step(policy: str) -> int:
        c = core(replace(ONE_RANK, max_num_seqs=4, max_num_batched_tokens=1024, scheduling_policy=policy))
        c.add_request(req("flex", list(range(8000)), n_out=4, priority=1 if policy == "priority" else 0))
        c.step(0.0)
        c.add_request(req("urgent", list(range(9000, 9500)), n_out=4, priority=-1 if policy == "priority" else 0))
        for step in range(1, 20):
            _, ups = c.step(0.0)
            if any(u.request_id == "urgent" and u.token_ids for u in ups):
                return step
        raise AssertionError("no first token")

    assert first_token_step("priority") == 1
    assert first_token_step("fcfs") > 1
