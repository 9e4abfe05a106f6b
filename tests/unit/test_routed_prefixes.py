"""kvcache/routed.py: a prompt just routed counts as cached on its worker for the TTL, leading
blocks only, the larger of it and the index's overlap winning, bounded."""

from __future__ import annotations

from deepinfer_gateway.kvcache.routed import RoutedPrefixes
from deepinfer_gateway.kvcache.types import Overlap

FORMATS = {"a": "fp8", "b": "fp8", "c": "int8"}


def test_a_routed_prompt_counts_on_its_worker_until_its_ttl() -> None:
    routed = RoutedPrefixes(ttl_s=2.0)
    routed.add("a", [1, 2, 3], now=10.0)
    assert routed.leading("a", [1, 2, 3, 4], 10.5) == 3
    assert routed.leading("a", [1, 9, 3], 10.5) == 1  # leading blocks only
    assert routed.leading("b", [1, 2, 3], 10.5) == 0
    assert routed.leading("a", [1, 2, 3], 12.0) == 0  # its TTL has run out
    routed.add("a", [1, 2], now=11.5)  # routed again: counts from then
    assert routed.leading("a", [1, 2, 3], 13.0) == 2


def test_merged_takes_the_larger_of_the_index_and_what_was_routed() -> None:
    routed = RoutedPrefixes(ttl_s=2.0)
    index = Overlap(memory={"a": 1, "b": 5}, store={"fp8": 2})
    assert routed.merged(index, {"fp8": [1, 2, 3]}, FORMATS, 0.0) is index  # nothing routed: the same object
    routed.add("a", [1, 2, 3], now=0.0)
    routed.add("b", [1, 2], now=0.0)
    routed.add("c", [7, 8], now=0.0)
    merged = routed.merged(index, {"fp8": [1, 2, 3, 4], "int8": [7, 8]}, FORMATS, 1.0)
    assert merged.memory == {"a": 3, "b": 5, "c": 2}  # b's index overlap is longer; c reads its own format
    assert merged.store == index.store


def test_the_oldest_blocks_go_first_past_the_bound() -> None:
    routed = RoutedPrefixes(ttl_s=60.0, max_blocks=4)
    routed.add("a", [1, 2, 3], now=0.0)
    routed.add("b", [4, 5], now=1.0)  # five blocks: a's first goes
    assert routed.leading("a", [1, 2, 3], 2.0) == 0 and routed.leading("a", [2, 3], 2.0) == 2
    assert routed.leading("b", [4, 5], 2.0) == 2
    routed.add("a", [2], now=3.0)  # routed again: its older entry expires without dropping it
    routed.add("c", [6, 7, 8], now=4.0)
    assert routed.leading("a", [2], 5.0) == 1
