"""Routing policies (see router/policy.py for the interface)."""

from __future__ import annotations

import itertools

from deepinfer_gateway.router.policy import Decision, Reason, RoutingView


class RoundRobin:
    """Cycles through candidates; ignores cache and load. The baseline every other policy beats."""

    name = "round_robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, view: RoutingView) -> Decision:
        ordered = sorted(view.candidates, key=lambda c: c.worker_id)
        return Decision(ordered[next(self._counter) % len(ordered)].worker_id, Reason.ROUND_ROBIN)


POLICIES = {RoundRobin.name: RoundRobin}


def make_policy(name: str) -> RoundRobin:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; choose one of {sorted(POLICIES)}") from None
