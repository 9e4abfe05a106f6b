"""Whether a session's round extends the session's previous prompt, from the prompts' chained
block hashes.

A session's follow-up hit is low for one of two reasons: the client broke its own prefix
(context compaction, an edited or truncated history: every router must prefill it again), or
the cache lost what the client kept (placement, eviction: the router's and the cache's). The
count of rounds that break tells an operator which. Chains are compared to the previous
prompt's last full block, in any KV format both prompts were hashed in (a block hash covers
every token before it).

Per process and bounded (least recently seen sessions forgotten): a round whose previous round
another replica served, or that was forgotten, is `unseen` here.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from enum import StrEnum

MAX_SESSIONS = 32768  # ~100 bytes of state each besides the key


class Continuity(StrEnum):
    EXTENDS = "extends"  # the previous prompt's full blocks start this one
    BREAKS = "breaks"  # they do not: compaction, an edited or truncated history
    UNSEEN = "unseen"  # no previous round here: the session's first, or another replica's


class SessionPrefixes:
    """Each live session's previous prompt, as its chain's length and last hash per KV format."""

    def __init__(self, max_sessions: int = MAX_SESSIONS):
        self._max = max_sessions
        self._tips: OrderedDict[str, dict[str, tuple[int, int]]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._tips)

    def observe(self, session: str, hashes: Mapping[str, Sequence[int]]) -> Continuity:
        """This round's continuity with the session's previous one; this round becomes the previous."""
        previous = self._tips.pop(session, None)
        tips = {fmt: (len(chain), chain[-1]) for fmt, chain in hashes.items() if chain}
        if tips:
            self._tips[session] = tips
            if len(self._tips) > self._max:
                self._tips.popitem(last=False)
        if previous is None:
            return Continuity.UNSEEN
        for fmt, (length, last) in previous.items():
            chain = hashes.get(fmt)
            if chain is not None:
                return Continuity.EXTENDS if len(chain) >= length and chain[length - 1] == last else Continuity.BREAKS
        return Continuity.UNSEEN  # no KV format in common (the healthy workers changed)
