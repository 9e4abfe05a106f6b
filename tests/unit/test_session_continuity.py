"""SessionPrefixes: whether a session's round extends its previous prompt, from block hash chains."""

from __future__ import annotations

from deepinfer_gateway.router.session_continuity import Continuity, SessionPrefixes


def test_a_round_that_starts_with_the_previous_prompt_extends_it() -> None:
    prefixes = SessionPrefixes()
    assert prefixes.observe("s", {"sm100": [1, 2, 3]}) is Continuity.UNSEEN
    assert prefixes.observe("s", {"sm100": [1, 2, 3, 4, 5]}) is Continuity.EXTENDS
    assert prefixes.observe("s", {"sm100": [1, 2, 3, 4, 5]}) is Continuity.EXTENDS  # a retry: the same prompt


def test_a_compacted_edited_or_shorter_history_breaks_it() -> None:
    prefixes = SessionPrefixes()
    prefixes.observe("s", {"sm100": [1, 2, 3]})
    assert prefixes.observe("s", {"sm100": [1, 9, 10, 11]}) is Continuity.BREAKS  # an edited second block
    assert prefixes.observe("s", {"sm100": [1, 9]}) is Continuity.BREAKS  # shorter than the previous
    assert prefixes.observe("s", {"sm100": []}) is Continuity.BREAKS  # under one block
    assert prefixes.observe("s", {"sm100": [7]}) is Continuity.UNSEEN  # nothing was left to compare


def test_sessions_are_apart_and_compared_in_a_kv_format_both_rounds_have() -> None:
    prefixes = SessionPrefixes()
    prefixes.observe("a", {"sm100": [1, 2], "ascend950": [5, 6]})
    prefixes.observe("b", {"sm100": [8]})
    assert prefixes.observe("a", {"ascend950": [5, 6, 7]}) is Continuity.EXTENDS  # the sm100 workers went away
    assert prefixes.observe("b", {"ascend950": [8, 9]}) is Continuity.UNSEEN  # no format in common
    assert prefixes.observe("a", {"ascend950": [4, 6, 8]}) is Continuity.BREAKS


def test_the_least_recently_seen_sessions_are_forgotten_past_the_bound() -> None:
    prefixes = SessionPrefixes(max_sessions=2)
    prefixes.observe("a", {"f": [1]})
    prefixes.observe("b", {"f": [2]})
    prefixes.observe("a", {"f": [1, 3]})  # a is now the most recent
    prefixes.observe("c", {"f": [4]})  # b goes
    assert len(prefixes) == 2
    assert prefixes.observe("b", {"f": [2, 5]}) is Continuity.UNSEEN
    assert prefixes.observe("a", {"f": [1, 3, 6]}) is Continuity.UNSEEN  # c and b pushed it out since
