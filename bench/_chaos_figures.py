"""bench/chaos.py's figures from the load's records (pure).

- A request is `answered` (a whole stream with its usage), `failed` (the client was told:
  an HTTP error, an error event, a connection refused or reset) or `lost` (neither: still
  unanswered at the end of the drain, a client timeout, or a stream that ended cleanly
  without its usage chunk).
- Follow-up hit rate: cached / prompt tokens summed over the answered follow-up turns.
- Recovery after a fault at `fault_s`: windows of `window_s` of send time start every
  `step_s` from the fault to the end of the phase; from the first window from which every
  window holds an answered follow-up and a hit rate at least (1 - tolerance) x the hit rate
  before the fault, the recovery time is the send time of that window's first answered
  follow-up, less the fault's. None when the phase's last window is not there yet.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from deepinfer_gateway.workload.types import RecordError, RequestRecord

ANSWERED, FAILED, LOST = "answered", "failed", "lost"
_UNTOLD = (RecordError.CANCELLED, RecordError.TIMEOUT)


def outcome(record: RequestRecord) -> str:
    if record.ok:
        return ANSWERED if record.prompt_tokens is not None else LOST
    return LOST if record.error in _UNTOLD else FAILED


@dataclass(frozen=True)
class Tally:
    total: int
    answered: int
    failed: int
    lost: int
    failed_by_kind: dict[str, int]  # RecordError value, with the HTTP status for HTTP errors
    examples: dict[str, str]  # kind -> the first such request's detail (failed and lost)


def tally(records: Iterable[RequestRecord]) -> Tally:
    counts: Counter[str] = Counter()
    kinds: Counter[str] = Counter()
    examples: dict[str, str] = {}
    for record in records:
        kind = outcome(record)
        counts[kind] += 1
        if kind == ANSWERED:
            continue
        label = f"{record.error}:{record.http_status}" if record.http_status else str(record.error)
        if kind == FAILED:
            kinds[label] += 1
        examples.setdefault(f"{kind} {label}", record.detail or "")
    return Tally(sum(counts.values()), counts[ANSWERED], counts[FAILED], counts[LOST], dict(sorted(kinds.items())),
                 examples)


@dataclass(frozen=True)
class HitSample:
    """One answered follow-up turn: when it was sent (s since the load started) and its tokens."""

    sent_s: float
    cached: int
    prompt: int


def hit_rate(samples: Iterable[HitSample]) -> float | None:
    cached = prompt = 0
    for s in samples:
        cached += s.cached
        prompt += s.prompt
    return cached / prompt if prompt else None


def between(samples: Sequence[HitSample], start_s: float, end_s: float) -> list[HitSample]:
    return [s for s in samples if start_s <= s.sent_s < end_s]


def recovery_s(samples: Sequence[HitSample], fault_s: float, end_s: float, before: float, window_s: float,
               step_s: float = 0.5, tolerance: float = 0.1) -> float | None:
    if window_s <= 0 or step_s <= 0:
        raise ValueError("window_s and step_s must be positive")
    threshold = (1 - tolerance) * before
    recovered: list[bool] = []
    k = 0
    while (start := fault_s + k * step_s) + window_s <= end_s + 1e-9:
        rate = hit_rate(between(samples, start, start + window_s))
        recovered.append(rate is not None and rate >= threshold)
        k += 1
    if not recovered or not recovered[-1]:
        return None
    first = len(recovered) - 1
    while first > 0 and recovered[first - 1]:
        first -= 1
    start = fault_s + first * step_s
    return round(min(s.sent_s for s in between(samples, start, start + window_s)) - fault_s, 3)
