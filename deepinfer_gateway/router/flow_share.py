"""One fair share across the routers that queue for the same pool (gateway replicas, processes, EPPs).

Each router keeps its own queues (flow.py); alone, its start-time fair queuing shares only what
it starts. Routers that share a Redis also exchange, per pool, what they hold: each band's queued
requests per tenant, and each tenant's recent service (tokens started / weight, halving every
`half_life_s`). With those, a router picks within a band the local tenant whose service summed
over every router is least (least attained service: backlogged tenants converge on equal
weighted service, whichever routers their requests reach) and yields a start, leaving the slot
to another router, when another router holds a request of a higher band, or of this band from a
tenant whose total service trails the pick's by more than the pick's own cost. Reports older than
`stale_s` count for nothing, so a router gone stops holding the others back. The exchange itself
is I/O (gateway/serving/flow_share_sync.py, router_exchange.py); everything here is pure, on the
caller's clock.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from deepinfer_gateway.router.flow import FlowRequest, Tier

Key = tuple[Tier, str]  # (band, tenant)

MAX_ENTRIES = 1024  # per report: the most-served and every queued tenant first
MIN_SERVICE = 1.0  # below a token's worth a tenant's service is forgotten


class Service:
    """Decayed service per (band, tenant): each amount halves every `half_life_s`."""

    __slots__ = ("half_life_s", "_values")

    def __init__(self, half_life_s: float) -> None:
        self.half_life_s = half_life_s
        self._values: dict[Key, tuple[float, float]] = {}  # key -> (value, as of)

    def add(self, key: Key, amount: float, now: float) -> None:
        self._values[key] = (self.value(key, now) + amount, now)

    def value(self, key: Key, now: float) -> float:
        held = self._values.get(key)
        return decayed(held[0], now - held[1], self.half_life_s) if held is not None else 0.0

    def current(self, now: float) -> dict[Key, float]:
        """Every key's value now; forgets those under MIN_SERVICE."""
        values = {key: self.value(key, now) for key in self._values}
        for key, value in values.items():
            if value < MIN_SERVICE:
                del self._values[key]
        return {key: value for key, value in values.items() if value >= MIN_SERVICE}


def decayed(value: float, age_s: float, half_life_s: float) -> float:
    return value * math.exp2(-max(0.0, age_s) / half_life_s)


@dataclass(frozen=True)
class Report:
    """What one router holds of one pool, as of `at` (on the reader's clock once received)."""

    at: float
    queued: dict[Key, int] = field(default_factory=dict)
    service: dict[Key, float] = field(default_factory=dict)


def encode(report: Report) -> str:
    """The report as the routers exchange it (its time goes beside it): [band, tenant, queued,
    service] rows, queued tenants first, then the most served, at most MAX_ENTRIES."""
    keys = sorted(set(report.queued) | set(report.service),
                  key=lambda k: (-report.queued.get(k, 0), -report.service.get(k, 0.0)))[:MAX_ENTRIES]
    return json.dumps([[int(band), tenant, report.queued.get((band, tenant), 0),
                        round(report.service.get((band, tenant), 0.0), 1)] for band, tenant in keys],
                      separators=(",", ":"))


def decode(text: str, at: float) -> Report | None:
    """A report read back, as of `at` (the reader's clock); None if it is not one (another
    version's, or damaged)."""
    try:
        queued: dict[Key, int] = {}
        service: dict[Key, float] = {}
        for band, tenant, count, served in json.loads(text)[:MAX_ENTRIES]:
            key = (Tier(band), str(tenant))
            if count:
                queued[key] = int(count)
            if served:
                service[key] = float(served)
    except (ValueError, TypeError, KeyError):
        return None
    return Report(at, queued, service)


class SharedShare:
    """One pool's fair share across routers: this router's service and the others' latest reports."""

    def __init__(self, half_life_s: float, stale_s: float) -> None:
        self.half_life_s = half_life_s
        self.stale_s = stale_s
        self.own = Service(half_life_s)
        self.others: list[Report] = []
        self._tops: list[tuple[Tier, float]] = []  # each other router's highest queued band, as of its report

    def served(self, request: FlowRequest, now: float) -> None:
        """`request` started here: its tenant's service grows by its cost over its weight."""
        self.own.add((request.tier, request.tenant), request.cost / request.weight, now)

    def total(self, key: Key, now: float) -> float:
        """The tenant's service in the band, over every router."""
        return self.own.value(key, now) + sum(decayed(r.service.get(key, 0.0), now - r.at, self.half_life_s)
                                              for r in self._fresh(now))

    def pick(self, candidates: Iterable[FlowRequest], tier: Tier, now: float) -> FlowRequest | None:
        """Of `tier`'s queued requests here (`candidates`, each tenant's first in its order), the one to
        start now: its tenant's total service is least. None: yield, another router should start first."""
        fresh = self._fresh(now)
        if any(count and band < tier for r in fresh for (band, _), count in r.queued.items()):
            return None  # a higher band waits at another router
        best, best_total = None, math.inf
        for request in candidates:
            served = self.total((tier, request.tenant), now)
            if served < best_total:
                best, best_total = request, served
        if best is None:
            return None
        behind = best_total - best.cost / best.weight
        for report in fresh:
            for (band, tenant), count in report.queued.items():
                if count and band == tier and tenant != best.tenant and self.total((band, tenant), now) < behind:
                    return None  # a tenant that trails this one waits at another router
        return best

    def waits_elsewhere(self, tier: Tier, now: float) -> bool:
        """Whether another router holds a request of `tier` or above: one of `tier` arriving here queues
        behind it rather than starting past it."""
        return any(top <= tier for top, at in self._tops if now - at <= self.stale_s)

    def heard(self, reports: list[Report]) -> None:
        """The other routers' latest reports."""
        self.others = reports
        self._tops = [(min(band for (band, _), count in r.queued.items() if count), r.at)
                      for r in reports if any(r.queued.values())]

    def report(self, queued: dict[Key, int], now: float) -> Report:
        """This router's report as of `now`."""
        return Report(now, queued, self.own.current(now))

    def _fresh(self, now: float) -> list[Report]:
        return [r for r in self.others if now - r.at <= self.stale_s]
