"""The planner's reuse of candidates across requests never changes a plan: one long-lived
planner, fed views that change a few at a time (as load reports and reservations move),
decides exactly as a fresh planner does on the same inputs."""

from __future__ import annotations

import random
from dataclasses import replace

from deepinfer_gateway.config import RouterSettings
from deepinfer_gateway.core.protocol import Role
from deepinfer_gateway.kvcache.types import Overlap
from deepinfer_gateway.router.planner import RoutePlanner, WorkerView
from deepinfer_gateway.router.policy import Columns, RoutingView, columns_of


def _rows(table: Columns) -> list[tuple[object, ...]]:
    return [(i, q, r, h, s, w, table.profile_values[p]) for i, q, r, h, s, w, p in
            zip(table.ids, table.queues, table.running, table.hits, table.stored, table.waits, table.profiles,
                strict=True)]


def _assert_columns_match(view: RoutingView) -> None:
    """The planner's incrementally kept columns say what the candidates say."""
    assert view.columns is not None
    assert _rows(view.columns) == _rows(columns_of(tuple(view.candidates)))


def _fleet(n: int) -> list[WorkerView]:
    views = []
    for i in range(n):
        role = Role.PREFILL if i % 2 else Role.DECODE
        hardware = "ascend950" if i % 8 < 2 else "sm100"
        views.append(WorkerView(worker_id=f"{role}-{i}", role=role, pool=str(role), hardware=hardware,
                                kv_format=f"fmt-{hardware}", model="m", dp_ranks=4))
    return views


def test_long_lived_planner_decides_as_a_fresh_one() -> None:
    rng = random.Random(7)
    views = _fleet(64)
    settings = RouterSettings(pd_bypass_tokens=256)
    kept = RoutePlanner(settings, clock=lambda: 0.0)
    for _ in range(300):
        for i in rng.sample(range(len(views)), rng.randint(0, 4)):  # a few views change
            views[i] = replace(views[i], queued_prefill_tokens=rng.randint(0, 50_000), running=rng.randint(0, 9))
        prompt = rng.randint(100, 20_000)
        memory = {v.worker_id: rng.choice((0, 0, 0, rng.randint(1, prompt // 128 + 1))) for v in views}
        store = {fmt: rng.choice((0, rng.randint(0, prompt // 128))) for fmt in ("fmt-sm100", "fmt-ascend950")}
        overlap = Overlap(memory, store) if rng.random() < 0.8 else Overlap()
        fresh = RoutePlanner(settings, clock=lambda: 0.0)
        got = kept.plan_first(list(views), prompt, {}, overlap)
        want = fresh.plan_first(list(views), prompt, {}, overlap)
        assert (got.mode, got.worker, got.decision, got.view) == (want.mode, want.worker, want.decision, want.view)
        _assert_columns_match(got.view)
        fmt = got.worker.kv_format
        assert kept.plan_decode(list(views), fmt, prompt) == fresh.plan_decode(list(views), fmt, prompt)
