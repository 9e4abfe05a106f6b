"""The simulator's load reports: `SchedulerCore.load_totals` sums what `rank_loads` reports."""

from __future__ import annotations

from dataclasses import replace

from deepinfer_gateway.core.protocol import FinishReason
from deepinfer_gateway.workers.sim.core import SchedulerCore, SimRequest
from deepinfer_gateway.workers.sim.kv_events import SimKvEventLog
from deepinfer_gateway.workers.sim.profiles import load_profile


def test_load_totals_sum_the_rank_loads_step_by_step() -> None:
    profile = replace(load_profile("sm100"), max_num_batched_tokens=3000, max_num_seqs=3)
    core = SchedulerCore(profile, SimKvEventLog("w"), "m")
    for i in range(40):
        core.add_request(SimRequest(str(i), [i % 7] * (500 + 397 * i), list(range(3 + i % 5)), FinishReason.LENGTH))
    seen = set()
    while core.has_work():
        ranks = core.rank_loads()
        totals = (sum(r.queued_prefill_tokens for r in ranks), sum(r.running for r in ranks))
        assert core.load_totals() == totals
        seen.add(totals)
        core.step(0.0)
    assert core.load_totals() == (0, 0) and len(seen) > 10
