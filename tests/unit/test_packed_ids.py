"""PackedIds: the same ids as the list it packs (length, items, slices, iteration, equality with
lists, tuples and itself), written to JSON exactly as orjson writes the list, inside any
structure; anything else orjson cannot write still fails."""

from __future__ import annotations

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer_gateway.kvcache.hashing import pack_tokens
from deepinfer_gateway.kvcache.packed_ids import _UNPACK_CHUNK, PackedIds, ids_json

id_lists = st.lists(st.integers(0, 2**32 - 1), max_size=300)


@settings(max_examples=300, deadline=None)
@given(ids=id_lists, start=st.integers(-5, 305), stop=st.integers(-5, 305))
def test_reads_as_the_list_it_packs(ids: list[int], start: int, stop: int) -> None:
    packed = PackedIds(pack_tokens(ids))
    assert len(packed) == len(ids) and list(packed) == ids and packed.ids == ids
    assert packed == ids and packed == tuple(ids) and packed == PackedIds(pack_tokens(ids))
    assert packed[start:stop] == ids[start:stop]
    if ids:
        assert packed[start % len(ids)] == ids[start % len(ids)] and packed[-1] == ids[-1]
    assert packed != [*ids, 0] and packed != PackedIds(pack_tokens([*ids, 0]))
    assert packed != "not ids"


@settings(max_examples=200, deadline=None)
@given(ids=id_lists)
def test_json_is_what_orjson_writes_for_the_list(ids: list[int]) -> None:
    body = {"request_id": "r", "token_ids": PackedIds(pack_tokens(ids)), "nested": [PackedIds(pack_tokens(ids))]}
    assert ids_json(body) == orjson.dumps({"request_id": "r", "token_ids": ids, "nested": [ids]})


def test_long_prompts_unpack_exactly_across_chunks() -> None:
    for n in (_UNPACK_CHUNK, _UNPACK_CHUNK + 1, 3 * _UNPACK_CHUNK + 17):
        ids = [(i * 7919) % 300_000 for i in range(n)]
        assert PackedIds(pack_tokens(ids)).ids == ids


def test_refuses_what_is_not_whole_words_and_what_json_cannot_write() -> None:
    with pytest.raises(ValueError, match="whole uint32 words"):
        PackedIds(b"\x01\x02\x03")
    with pytest.raises(TypeError):
        ids_json({"token_ids": object()})
