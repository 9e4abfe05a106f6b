"""`PromptIds`: the simulator's lazily built prompt reads exactly as the built list."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer_gateway.simulate.tokens import PromptTokens
from deepinfer_gateway.workload.types import TraceRequest

_REQUESTS = st.builds(
    TraceRequest, st.integers(0, 50), st.just(0.0), st.integers(0, 2100), st.integers(1, 8),
    st.one_of(st.none(), st.lists(st.integers(0, 10**9), max_size=6).map(tuple)),
)


@settings(max_examples=200, deadline=None)
@given(_REQUESTS, st.booleans(), st.lists(st.integers(0, 99), max_size=5), st.integers(-2200, 2200),
       st.integers(-2200, 2200))
def test_slices_and_items_equal_the_built_prompt(request: TraceRequest, header: bool, extra: list[int],
                                                 start: int, stop: int) -> None:
    prompts = PromptTokens(512, header=header)
    built = prompts.prompt(request) + extra
    ids = prompts.ids(request) + extra
    assert len(ids) == len(built)
    assert ids[start:stop] == built[start:stop]
    assert ids[start:] == built[start:] and ids[:stop] == built[:stop]
    assert ids[::3] == built[::3]
    assert ids == built and list(ids) == built
    if -len(built) <= start < len(built):
        assert ids[start] == built[start]
