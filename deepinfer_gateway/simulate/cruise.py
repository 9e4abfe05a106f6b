"""Steady decode stretches in one go: `CruisingCore`, an exact shortcut over `SchedulerCore`.

Most engine steps of a trace replay are decode-only: every running request is past its
prefill, nothing waits, and each step emits 1 to 1 + `nextn` tokens per request (core.py's
draws) in the same time, until the first request may finish. Calling `step()` once per token costs
~15 us each (millions of calls for an hour of trace on a large cluster), so the
simulator asks `steady()` for that stretch and `cruise(n)` runs n such steps at once.

Exactness: `cruise(n)` does what n calls of `step()` would do in a steady state, and
nothing else: `_admit` has nobody to admit, no prefill chunk runs, no KV block is cached
or evicted (no KV events), no request finishes (n is kept below the first finish), so
the step time is the same every step (`decode_seconds` of the busiest DP rank, divided
by `time_scale`). Each request's speculative draws come from its own RNG, one per step in
step order, as `step()` makes them. The stretch is counted at the most tokens a step can
emit (1 + `nextn`), so no request can finish within it whatever the draws.
tests/unit/test_simulate.py (`test_steady_stretches_match_step_by_step`) checks every
request's tokens and times against a run with cruising off.

Coupling: this subclass reads the scheduler's private per-rank queues (`_waiting`,
`_running`) and advances `_Seq.emitted`; workers/sim/core.py has no hook for it. The
equality test fails if core's stepping rules change underneath it.
"""

from __future__ import annotations

from deepinfer_gateway.workers.sim.core import SchedulerCore
from deepinfer_gateway.workers.sim.step_model import decode_seconds


class CruisingCore(SchedulerCore):
    def steady(self) -> tuple[float, int] | None:
        """(seconds per step, steps until the first request finishes) when every step until
        then is the same decode-only step; None otherwise."""
        if any(self._waiting):
            return None
        per_step = 1 + self.profile.nextn  # the most a step can emit
        until: int | None = None
        slowest = 0.0
        for running in self._running:
            if not running:
                continue
            for seq in running:
                if not seq.prefilled or seq.req.stop_after_first:
                    return None
                steps = -(-(len(seq.req.output) - seq.emitted) // per_step)
                if until is None or steps < until:
                    until = steps
            slowest = max(slowest, decode_seconds(self.profile, len(running)))
        if until is None:
            return None
        return slowest / self.time_scale, until

    def cruise(self, steps: int) -> list[tuple[str, list[int]]]:
        """Run `steps` steady steps (fewer than `steady()`'s count); the tokens per request."""
        out: list[tuple[str, list[int]]] = []
        step_tokens = self.step_tokens
        for running in self._running:
            for seq in running:
                n = sum(step_tokens(seq) for _ in range(steps))
                new = seq.req.output[seq.emitted : seq.emitted + n]
                seq.emitted += len(new)
                out.append((seq.req.request_id, new))
        return out
