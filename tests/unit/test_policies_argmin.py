"""The policies' argmin helpers pick what a min over (key..., worker id, index) tuples picks,
ties and repeated worker ids included."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer_gateway.router.policies import _cheapest, least_load_index
from deepinfer_gateway.router.policy import Columns

_ROWS = st.lists(st.tuples(st.sampled_from((0.0, -0.0, 0.5, 1.25, 1e-9, 3.0)), st.sampled_from("abcd"),
                           st.integers(0, 3), st.integers(0, 2), st.booleans()), min_size=1, max_size=12)


@settings(max_examples=400, deadline=None)
@given(_ROWS)
def test_cheapest_is_the_tuple_min(rows: list[tuple[float, str, int, int, bool]]) -> None:
    seconds, ids = [r[0] for r in rows], [r[1] for r in rows]
    chosen = [r[4] for r in rows]
    ranked = list(zip(seconds, ids, range(len(ids)), strict=True))
    assert _cheapest(seconds, ids) == min(ranked)[2]
    among = [t for t, keep in zip(ranked, chosen, strict=True) if keep]
    assert _cheapest(seconds, ids, iter(chosen)) == (min(among)[2] if among else None)


@settings(max_examples=400, deadline=None)
@given(_ROWS)
def test_least_load_index_is_the_tuple_min(rows: list[tuple[float, str, int, int, bool]]) -> None:
    ids, queues, running = [r[1] for r in rows], [r[2] * 100 for r in rows], [r[3] for r in rows]
    table = Columns(ids=ids, queues=queues, running=running, hits=[0] * len(ids), stored=[0] * len(ids),
                    waits=[0.0] * len(ids), crowds=[(0, 0, 0, 0, 0.0)] * len(ids), profiles=[0] * len(ids),
                    profile_values=[(1, 1.0, 1.0, 1.0)])
    assert least_load_index(table) == min(zip(queues, running, ids, range(len(ids)), strict=True))[3]
