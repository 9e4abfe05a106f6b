"""What a simulation run counts: events, engine steps, time, cache tiers and routing modes."""

from __future__ import annotations

from dataclasses import dataclass, field

from deepinfer_gateway.workload.summary import TierTokens


@dataclass
class SimStats:
    heap_events: int = 0  # events popped from the heap (a steady stretch of steps is one)
    steps: int = 0  # engine steps simulated, singly or in steady stretches
    wall_s: float = 0.0  # real seconds the loop took
    sim_s: float = 0.0  # virtual seconds simulated
    memory_tokens: int = 0
    store_tokens: int = 0
    prompt_tokens: int = 0
    modes: dict[str, int] = field(default_factory=dict)
    session_waits: int = 0  # session capacity: rounds that waited for room
    session_wait_s: float = 0.0  # their waits, summed (virtual seconds)
    session_proceeded: int = 0  # of them, those that went at the longest wait, without room

    other_events: int = 0  # arrivals, hand-offs, load-report and KV-feed ticks

    @property
    def events(self) -> int:
        """Discrete events simulated: every engine step, arrival, hand-off and tick."""
        return self.steps + self.other_events

    @property
    def events_per_s(self) -> float:
        return self.events / self.wall_s if self.wall_s else 0.0

    def tiers(self) -> TierTokens:
        return TierTokens(memory=self.memory_tokens, store=self.store_tokens, prompt=self.prompt_tokens)
