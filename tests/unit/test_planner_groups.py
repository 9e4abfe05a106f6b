"""A long-lived planner, whose pools redo only the views that changed since their last
request, plans as a fresh planner does while the fleet churns: views change a few at a
time, workers leave and come back, change pool, or are excluded for one request."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from deepinfer_gateway.config import RouterSettings
from deepinfer_gateway.core.protocol import Role
from deepinfer_gateway.kvcache.types import Overlap
from deepinfer_gateway.router.planner import RoutePlanner, WorkerView
from deepinfer_gateway.simulate.views import ViewList


def _fleet(n: int) -> list[WorkerView]:
    views = []
    for i in range(n):
        role = (Role.PREFILL, Role.DECODE, Role.UNIFIED)[i % 3] if i < n - 6 else Role.DECODE
        hardware = "ascend950" if i % 8 < 2 else "sm100"
        views.append(WorkerView(worker_id=f"{role}-{i}", role=role, pool=str(role), hardware=hardware,
                                kv_format=f"fmt-{hardware}", model="m", dp_ranks=4))
    return views


def _churn(rng: random.Random, views: list[WorkerView], all_views: list[WorkerView]) -> list[WorkerView]:
    roll = rng.random()
    if roll < 0.05 and len(views) > 10:  # a worker leaves
        views = list(views)
        del views[rng.randrange(len(views))]
    elif roll < 0.10:  # the fleet is whole again
        views = [next((v for v in views if v.worker_id == w.worker_id), w) for w in all_views]
    elif roll < 0.13:  # a worker moves to another pool
        views = list(views)
        i = rng.randrange(len(views))
        views[i] = replace(views[i], pool=rng.choice(("extra", str(views[i].role))))
    for i in rng.sample(range(len(views)), rng.randint(0, 4)):  # a few loads change
        views[i] = replace(views[i], queued_prefill_tokens=rng.randint(0, 50_000), running=rng.randint(0, 9))
    return views


def test_long_lived_planner_plans_as_a_fresh_one_while_the_fleet_churns() -> None:
    rng = random.Random(11)
    all_views = _fleet(60)
    views = list(all_views)
    kept = RoutePlanner(RouterSettings(pd_bypass_tokens=256), clock=lambda: 0.0)
    for _ in range(600):
        views = _churn(rng, views, all_views)
        prompt = rng.randint(100, 20_000)
        memory = {v.worker_id: rng.choice((0, 0, 0, rng.randint(1, prompt // 128 + 1))) for v in views}
        store = {fmt: rng.choice((0, rng.randint(0, prompt // 128))) for fmt in ("fmt-sm100", "fmt-ascend950")}
        overlap = Overlap(memory, store) if rng.random() < 0.8 else Overlap()
        exclude = frozenset(rng.sample([v.worker_id for v in views], 2)) if rng.random() < 0.1 else frozenset()
        fresh = RoutePlanner(RouterSettings(pd_bypass_tokens=256), clock=lambda: 0.0)
        got = kept.plan_first(list(views), prompt, {}, overlap, exclude=exclude)
        want = fresh.plan_first(list(views), prompt, {}, overlap, exclude=exclude)
        assert (got.mode, got.worker, got.decision, got.view) == (want.mode, want.worker, want.decision, want.view)
        for fmt in ("fmt-sm100", "fmt-ascend950"):
            assert kept.plan_decode(list(views), fmt, prompt) == fresh.plan_decode(list(views), fmt, prompt)


def test_a_view_list_tells_the_planner_where_to_look() -> None:
    """Fed one `ViewList` whose views are replaced in place (as the simulator does), with
    plain lists in between (an excluded worker) and more replacements than it remembers,
    a long-lived planner plans as a fresh one on a copy."""
    rng = random.Random(5)
    views = ViewList(_fleet(30))
    kept = RoutePlanner(RouterSettings(pd_bypass_tokens=256), clock=lambda: 0.0)
    for step in range(400):
        for i in rng.choices(range(len(views)), k=rng.choice((0, 1, 3, 200 if step % 50 == 0 else 2))):
            views[i] = replace(views[i], queued_prefill_tokens=rng.randint(0, 50_000), running=rng.randint(0, 9))
        prompt = rng.randint(100, 20_000)
        memory = {v.worker_id: rng.choice((0, 0, rng.randint(1, prompt // 128 + 1))) for v in views}
        overlap = Overlap(memory, {"fmt-sm100": rng.randint(0, 3)})
        exclude = frozenset([views[rng.randrange(len(views))].worker_id]) if rng.random() < 0.1 else frozenset()
        fresh = RoutePlanner(RouterSettings(pd_bypass_tokens=256), clock=lambda: 0.0)
        got = kept.plan_first(views, prompt, {}, overlap, exclude=exclude)
        want = fresh.plan_first(list(views), prompt, {}, overlap, exclude=exclude)
        assert (got.mode, got.worker, got.decision, got.view) == (want.mode, want.worker, want.decision, want.view)
        assert kept.plan_decode(views, "fmt-sm100", prompt) == fresh.plan_decode(list(views), "fmt-sm100", prompt)


def test_a_view_list_only_replaces_single_positions() -> None:
    views = ViewList(_fleet(4))
    mark = views.mark
    views[1] = views[2]
    views[-1] = views[0]
    assert views.replaced_since(mark) == [1, 3] and views.replaced_since(views.mark) == []
    for mutate in (lambda: views.append(views[0]), lambda: views.pop(), lambda: views.__delitem__(0),
                   lambda: views.__setitem__(slice(0, 1), [views[0]]), lambda: views.sort(key=id)):
        with pytest.raises(TypeError):
            mutate()
    assert len(views) == 4
    for _ in range(4 * ViewList._KEEP * len(views)):
        views[0] = views[1]
    assert views.replaced_since(mark) is None  # forgotten: the planner compares every view
