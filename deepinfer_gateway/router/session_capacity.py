"""Sessions under cache pressure, as pure code: which agent sessions each worker's KV cache
holds, and which session's next round waits for room.

An agent session sends rounds one after another with a tool call between them, each round's
prompt the whole conversation so far. A worker serving more live sessions than its cache holds
evicts their contexts in turn, and every round recomputes its whole context (thrash). This
policy keeps each worker's live sessions within its cache:

- A session is live on a worker from the moment its round is placed there (`begin`) until
  `ttl_s` after its last round in flight ends (`end`: the tool call before the next round).
  Its context counts `blocks` (its latest prompt, in KV blocks) against the worker's capacity
  (the engine's reported `memory_capacity_blocks`; 0, unknown: the worker is not limited).
- A new round of session S (`place`):
  - S live on a worker (here, or at another router): it goes there at once (its context is
    counted already);
  - else the worker whose cache holds at least `hold_share` of the prompt (the prefix index's
    overlap) is its holder: the round goes there at once if its context fits beside the live
    ones (within capacity x (1 - headroom)) and no round waits there before it, else it waits
    for that worker, pinned to it (moving it would recompute its context elsewhere and evict
    another's). Unless other workers cache nearly as much (less than `hold_share` of the
    prompt short of the holder: a system prompt and tools every session shares, its own
    context evicted): it is held to none of them, and goes to whichever of them has room, or
    waits unpinned for the first of them to have some (pinned, such rounds would all line up
    for the one worker the ties pick);
  - else (cached nowhere worth keeping: a first round, a context already evicted) it goes to
    a worker with room (the planner chooses among them) unless unpinned rounds wait for those
    workers before it; else it waits unpinned, for whichever of its candidate workers (those
    asked about) has room first.
- Pinned rounds start first come first served per worker (`starts`): the head starts when its
  context fits, and none behind it overtakes it, so no session starves. Unpinned rounds wait in
  one line (`starts_floating`): each, in arrival order, starts on the candidate with the most
  free room where it fits and no pinned round waits (a pinned line has that worker first); one
  that fits nowhere holds its candidates for itself, so none behind it overtakes it there. A
  round that has waited `max_wait_s` starts anyway (`Start.timed_out`; an unpinned one on its
  least used candidate). A worker with nothing live takes any round, however large.

Routers that share the workers (gateway replicas on one Redis) tell each other their live
sessions (`live_report`; gateway/serving/session_share_sync.py): the blocks other routers'
live sessions hold on a worker, those not live here (`external_use`), count against its room
as this router's own do (`set_external`). They also tell each other how long their rounds have
waited for each worker (`wait_report`, `external_waits`), so first come first served holds
across routers: a newcomer takes no worker another router's round waits for, and a waiting
round starts only if no other router's round has waited longer for that worker
(`set_external_waits`; arrivals within `ARRIVAL_SKEW_S` of each other count as together, both
go, lest two routers each yield to the other).

Cost: a dict lookup per decision plus one pass over the candidate workers; expiries come off
a heap. No I/O, the clock is a parameter: the gateway (gateway/serving/session_gate.py) and the
simulator (simulate/gateway.py) run this same code.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Container, Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from deepinfer_gateway.config import SessionCapacitySettings
from deepinfer_gateway.core.protocol import KV_BLOCK_TOKENS

# Two routers' clocks meet through their reports' ages: an arrival less than this before a
# local round's counts as at the same time (both go: a possible overfill, never a stall).
ARRIVAL_SKEW_S = 0.05


@dataclass(frozen=True)
class CapacityLimits:
    ttl_s: float = 3.0
    headroom: float = 0.1
    max_wait_s: float = 10.0
    hold_share: float = 0.5

    @classmethod
    def of(cls, settings: SessionCapacitySettings) -> CapacityLimits:
        return cls(ttl_s=settings.ttl_ms / 1000.0, headroom=settings.headroom,
                   max_wait_s=settings.max_wait_ms / 1000.0, hold_share=settings.hold_share)


def blocks_of(tokens: int) -> int:
    """KV blocks a context of `tokens` tokens fills."""
    return -(-tokens // KV_BLOCK_TOKENS)


class Verdict(StrEnum):
    """What `place` decided (a bounded metrics label)."""

    GO = "go"  # place it now
    WAIT = "wait"  # wait for room on `Placement.worker`


@dataclass(frozen=True)
class Placement:
    """`GO` with `worker` set: its session's worker; with `avoid`: the workers for the planner
    to leave out (without room, or not among a shared prefix's holders). `WAIT` with `worker`
    set: the worker whose room it waits for (pinned); without: room on any of `candidates`
    (unpinned)."""

    verdict: Verdict
    worker: str | None = None
    avoid: frozenset[str] = frozenset()
    candidates: frozenset[str] = frozenset()  # unpinned `WAIT`: the workers whose room it waits for


@dataclass(eq=False)
class Waiter:
    """A round waiting for room on `worker` (pinned), or, `worker` None, on any of `candidates`
    (unpinned: the placement's workers). `handle`: the caller's (e.g. the future to resolve)."""

    session: str
    blocks: int
    worker: str | None
    arrival: float
    handle: object = None
    candidates: frozenset[str] = frozenset()
    queued: bool = field(default=False, init=False)

    @property
    def pinned(self) -> bool:
        return self.worker is not None


@dataclass(frozen=True)
class Start:
    waiter: Waiter
    timed_out: bool  # it waited max_wait_s without room and starts anyway
    worker: str  # where it began (an unpinned waiter's pick among its candidates)


@dataclass
class _Live:
    worker: str
    blocks: int
    rounds: int = 0  # rounds in flight
    until: float = math.inf  # when it stops being live (never while a round is in flight)


class SessionCapacity:
    """Every worker's live sessions and waiting rounds (module doc)."""

    def __init__(self, limits: CapacityLimits) -> None:
        self.limits = limits
        self._live: dict[str, _Live] = {}
        self._on: dict[str, dict[str, _Live]] = {}  # worker -> its live sessions
        self._used: dict[str, int] = {}  # worker -> its live sessions' blocks
        self._queues: dict[str, deque[Waiter]] = {}  # worker -> the rounds pinned to it
        self._floating: deque[Waiter] = deque()  # the unpinned rounds, in arrival order
        self._floating_on: dict[str, int] = {}  # worker -> unpinned rounds it is a candidate of
        self._expiring: list[tuple[float, str]] = []  # (until, session), stale entries skipped
        self._external = ExternalUse()  # other routers' live sessions
        self._external_waits: dict[str, float] = {}  # worker -> other routers' oldest waiting round's arrival

    # --- what is live ----------------------------------------------------------------------

    def where(self, session: str, now: float) -> str | None:
        self._expire(now)
        live = self._live.get(session)
        return live.worker if live is not None else None

    def used(self, worker: str, now: float) -> int:
        self._expire(now)
        return self._used.get(worker, 0)

    def live_sessions(self, worker: str) -> int:
        return len(self._on.get(worker, ()))

    def fits(self, worker: str, blocks: int, capacity: int, now: float, session: str | None = None) -> bool:
        """Whether a context of `blocks` fits on `worker` beside its live sessions, other routers'
        included but for `session`'s own (it always does on a worker of unknown capacity, or one
        with nothing live)."""
        self._expire(now)
        external = self._external_on(worker, session)
        if capacity <= 0 or not (self._on.get(worker) or external):
            return True
        return self._used.get(worker, 0) + external + blocks <= capacity * (1.0 - self.limits.headroom)

    def _external_on(self, worker: str, session: str | None) -> int:
        """Blocks other routers' live sessions hold on `worker`, `session`'s own left out."""
        used = self._external.used.get(worker, 0)
        if used and session is not None:
            own = self._external.sessions.get(session)
            if own is not None and own[0] == worker:
                used -= own[1]
        return used

    def _live_on(self, session: str) -> str | None:
        """The worker `session` is live on, here or at another router."""
        live = self._live.get(session)
        if live is not None:
            return live.worker
        elsewhere = self._external.sessions.get(session)
        return elsewhere[0] if elsewhere is not None else None

    def _in_use(self, worker: str, session: str | None = None) -> int:
        return self._used.get(worker, 0) + self._external_on(worker, session)

    def set_external(self, external: ExternalUse) -> None:
        """What other routers' live sessions hold (`external_use`)."""
        self._external = external

    def set_external_waits(self, arrivals: dict[str, float]) -> None:
        """worker -> when other routers' oldest round waiting for it arrived, on this clock
        (`external_waits`)."""
        self._external_waits = arrivals

    def wait_report(self, now: float) -> dict[str, float]:
        """worker -> how long the oldest round waiting here for it has waited (pinned to it, or
        unpinned with it among its candidates): what other routers yield to."""
        oldest: dict[str, float] = {}
        for worker, queue in self._queues.items():
            oldest[worker] = queue[0].arrival
        for waiter in self._floating:
            for worker in waiter.candidates:
                if waiter.arrival < oldest.get(worker, math.inf):
                    oldest[worker] = waiter.arrival
        return {worker: max(0.0, now - arrival) for worker, arrival in oldest.items()}

    def _yields(self, worker: str, arrival: float | None) -> bool:
        """Whether a round that arrived at `arrival` (None: a newcomer, arriving now) gives
        `worker` to another router's round that has waited for it longer."""
        before = self._external_waits.get(worker)
        return before is not None and (arrival is None or before < arrival - ARRIVAL_SKEW_S)

    def live_report(self, now: float) -> dict[str, dict[str, int]]:
        """worker -> {session: blocks} of the sessions live here: what other routers count."""
        self._expire(now)
        return {worker: {session: live.blocks for session, live in on.items()} for worker, on in self._on.items()}

    def any_live(self) -> bool:
        return bool(self._live)

    @property
    def sessions(self) -> Container[str]:
        """The sessions live here."""
        return self._live.keys()

    def _room(self, worker: str, blocks: int, capacity: int, now: float, session: str | None = None,
              arrival: float | None = None) -> bool:
        """Whether a round that arrived at `arrival` (None: now) may start on `worker`: no round
        waits for it before this one, here or at another router, and its context fits."""
        return (not self._queues.get(worker) and not self._yields(worker, arrival)
                and self.fits(worker, blocks, capacity, now, session))

    # --- decisions ------------------------------------------------------------------------

    def place(self, session: str, blocks: int, capacities: Mapping[str, int], cached: Mapping[str, int],
              now: float) -> Placement:
        """Where a new round of `session` (its prompt: `blocks`) may go now, among the workers of
        `capacities` (worker -> capacity in blocks); `cached`: worker -> leading blocks of the
        prompt in its cache."""
        self._expire(now)
        worker = self._live_on(session)
        if worker is not None and worker in capacities:
            return Placement(Verdict.GO, worker)
        holder, held = None, 0
        for worker in capacities:
            hit = cached.get(worker, 0)
            if hit > held or (hit == held and holder is not None and worker < holder):
                holder, held = worker, hit
        keep = self.limits.hold_share * blocks
        if holder is not None and held >= keep:
            if self._room(holder, blocks, capacities[holder], now, session):
                return Placement(Verdict.GO, holder)
            # Workers where the round would recompute less than `keep` more than on its holder:
            # a prefix cached on several (a shared system prompt, tools) holds it to none of them.
            alike = frozenset(w for w in capacities if held - cached.get(w, 0) < keep)
            if len(alike) == 1:
                return Placement(Verdict.WAIT, holder)
            return self._unpinned(session, blocks, capacities, alike, now)
        return self._unpinned(session, blocks, capacities, frozenset(capacities), now)

    def _unpinned(self, session: str, blocks: int, capacities: Mapping[str, int], candidates: frozenset[str],
                  now: float) -> Placement:
        """A round held by no one worker, among `candidates`: on to the planner, away from those
        without room, if one has room and no unpinned round waits for them before it; else it
        waits for the first of them to have room."""
        full = frozenset(w for w in candidates if not self._room(w, blocks, capacities[w], now, session))
        if len(full) < len(candidates) and not any(w in self._floating_on for w in candidates):
            return Placement(Verdict.GO, avoid=full | (capacities.keys() - candidates))
        return Placement(Verdict.WAIT, candidates=candidates)

    def begin(self, session: str, worker: str, blocks: int, now: float) -> None:
        """A round of `session` (its prompt: `blocks`) was placed on `worker`: the session is live
        there (moved off any other worker) until `ttl_s` after its last round ends."""
        self._expire(now)
        live = self._live.get(session)
        if live is None:
            live = self._live[session] = _Live(worker, 0)
            self._on.setdefault(worker, {})[session] = live
        elif live.worker != worker:
            self._detach(session, live)
            live.worker, live.blocks = worker, 0
            self._on.setdefault(worker, {})[session] = live
        self._used[worker] = self._used.get(worker, 0) + blocks - live.blocks
        live.blocks = blocks
        live.rounds += 1
        live.until = math.inf

    def move(self, session: str, worker: str, now: float) -> None:
        """The round begun elsewhere (a waiter started by `starts`) was planned on `worker`."""
        live = self._live.get(session)
        if live is not None and live.worker != worker:
            self._detach(session, live)
            live.worker = worker
            self._on.setdefault(worker, {})[session] = live
            self._used[worker] = self._used.get(worker, 0) + live.blocks

    def end(self, session: str, now: float) -> None:
        """A round of `session` ended (answered or failed): its TTL starts once none is in flight."""
        live = self._live.get(session)
        if live is None or live.rounds <= 0:
            return
        live.rounds -= 1
        if not live.rounds:
            live.until = now + self.limits.ttl_s
            heapq.heappush(self._expiring, (live.until, session))
            self._expire(now)

    # --- the waiting rounds ---------------------------------------------------------------

    def wait(self, waiter: Waiter) -> None:
        """`waiter` waits from now on: pinned in its worker's line, else in the unpinned line."""
        if waiter.worker is not None:
            self._queues.setdefault(waiter.worker, deque()).append(waiter)
        else:
            self._floating.append(waiter)
            for worker in waiter.candidates:
                self._floating_on[worker] = self._floating_on.get(worker, 0) + 1
        waiter.queued = True

    def remove(self, waiter: Waiter) -> bool:
        """Take a waiting round out (its client left); False if it no longer waits."""
        if not waiter.queued:
            return False
        if waiter.worker is not None:
            waiter.queued = False
            queue = self._queues[waiter.worker]
            queue.remove(waiter)
            if not queue:
                del self._queues[waiter.worker]
        else:
            self._floating.remove(waiter)
            self._unfloat(waiter)
        return True

    def waiting_workers(self) -> list[str]:
        """The workers pinned rounds wait for (`starts`)."""
        return list(self._queues)

    def floating_workers(self) -> list[str]:
        """The workers unpinned rounds may start on (`starts_floating`)."""
        return list(self._floating_on)

    def any_waiting(self) -> bool:
        return bool(self._queues or self._floating)

    def waiting(self, worker: str) -> int:
        return len(self._queues.get(worker, ()))

    def starts(self, worker: str, capacity: int, now: float) -> list[Start]:
        """The rounds waiting for `worker` that start now, in arrival order, each begun there: the
        head while it fits, or once it has waited `max_wait_s`."""
        queue = self._queues.get(worker)
        started: list[Start] = []
        while queue:
            head = queue[0]
            timed_out = False
            if not (self._live_on(head.session) == worker
                    or (not self._yields(worker, head.arrival)
                        and self.fits(worker, head.blocks, capacity, now, head.session))):
                if now < head.arrival + self.limits.max_wait_s:  # as `next_change` computes it
                    break
                timed_out = True
            queue.popleft()
            head.queued = False
            self.begin(head.session, worker, head.blocks, now)
            started.append(Start(head, timed_out, worker))
        if queue is not None and not queue:
            del self._queues[worker]
        return started

    def starts_floating(self, capacities: Mapping[str, int], now: float) -> list[Start]:
        """The unpinned rounds that start now, in arrival order, each begun on its pick among its
        candidates that are in `capacities` (worker -> capacity in blocks): its session's worker
        when live on one, else the one with the most free room (ties by name) where it fits and no
        pinned round waits; once it has waited `max_wait_s`, its least used candidate. A round
        that starts nowhere keeps its candidates from the rounds behind it (first come first
        served)."""
        self._expire(now)
        started: list[Start] = []
        held: set[str] = set()  # candidates of the rounds ahead that could not start
        kept: list[Waiter] = []
        floating = self._floating
        while floating:
            waiter = floating[0]
            worker = self._floating_pick(waiter, capacities, held, now)
            timed_out = False
            if worker is None:
                if now < waiter.arrival + self.limits.max_wait_s:  # as `next_change` computes it
                    kept.append(floating.popleft())
                    held |= waiter.candidates
                    if held.issuperset(self._floating_on):  # none behind it can start anywhere
                        break
                    continue
                timed_out = True
                present = [w for w in waiter.candidates if w in capacities] or list(waiter.candidates)
                worker = min(present, key=lambda w: (self._in_use(w), w))
            floating.popleft()
            self._unfloat(waiter)
            self.begin(waiter.session, worker, waiter.blocks, now)
            started.append(Start(waiter, timed_out, worker))
        floating.extendleft(reversed(kept))
        return started

    def next_change(self, now: float) -> float | None:
        """When `starts` or `starts_floating` may next answer otherwise with nothing else
        happening (a session's TTL ends, a head's wait runs out); None when no round waits."""
        if not self._queues and not self._floating:
            return None
        self._expire(now)
        times = [q[0].arrival + self.limits.max_wait_s for q in self._queues.values()]
        if self._floating:
            times.append(self._floating[0].arrival + self.limits.max_wait_s)
        if self._expiring:
            times.append(self._expiring[0][0])
        return min(times)

    # --- bookkeeping ------------------------------------------------------------------------

    def _floating_pick(self, waiter: Waiter, capacities: Mapping[str, int], held: set[str],
                       now: float) -> str | None:
        """Where an unpinned round may start now, none of `held`: None when nowhere."""
        live = self._live_on(waiter.session)
        if live is not None and live in waiter.candidates and live in capacities:
            return live  # its context is counted there already
        best, best_free = None, -math.inf
        for worker in waiter.candidates:
            capacity = capacities.get(worker)
            if capacity is None or worker in held or not self._room(worker, waiter.blocks, capacity, now,
                                                                    waiter.session, waiter.arrival):
                continue
            free = (capacity * (1.0 - self.limits.headroom) - self._in_use(worker, waiter.session) if capacity > 0
                    else math.inf)
            if free > best_free or (free == best_free and best is not None and worker < best):
                best, best_free = worker, free
        return best

    def _unfloat(self, waiter: Waiter) -> None:
        waiter.queued = False
        for worker in waiter.candidates:
            left = self._floating_on[worker] - 1
            if left:
                self._floating_on[worker] = left
            else:
                del self._floating_on[worker]

    def _detach(self, session: str, live: _Live) -> None:
        on = self._on[live.worker]
        del on[session]
        self._used[live.worker] -= live.blocks
        if not on:
            del self._on[live.worker]
            del self._used[live.worker]

    def _expire(self, now: float) -> None:
        expiring = self._expiring
        while expiring and expiring[0][0] <= now:
            until, session = heapq.heappop(expiring)
            live = self._live.get(session)
            if live is not None and live.rounds == 0 and live.until == until:
                self._detach(session, live)
                del self._live[session]


@dataclass(frozen=True)
class ExternalUse:
    """Other routers' live sessions not live here: `used`, worker -> their blocks there;
    `sessions`, session -> (its worker, its blocks)."""

    used: dict[str, int] = field(default_factory=dict)
    sessions: dict[str, tuple[str, int]] = field(default_factory=dict)


def external_waits(reports: Iterable[tuple[float, Mapping[str, float]]]) -> dict[str, float]:
    """worker -> the arrival of the oldest round other routers hold waiting for it, on this
    router's clock (`reports`: each `wait_report` with when it was written on this clock)."""
    arrivals: dict[str, float] = {}
    for at, waits in reports:
        for worker, waited in waits.items():
            arrival = at - waited
            if arrival < arrivals.get(worker, math.inf):
                arrivals[worker] = arrival
    return arrivals


def external_use(reports: Iterable[Mapping[str, Mapping[str, int]]], local: Container[str]) -> ExternalUse:
    """What other routers' live sessions hold (`reports`: their `live_report`s), a session live on
    several routers counted once (its largest context) and one live here (`local`) not at all:
    this router counts it itself."""
    sessions: dict[str, tuple[str, int]] = {}
    for report in reports:
        for worker, live in report.items():
            for session, blocks in live.items():
                if session not in local and blocks > sessions.get(session, ("", 0))[1]:
                    sessions[session] = (worker, blocks)
    used: dict[str, int] = {}
    for worker, blocks in sessions.values():
        used[worker] = used.get(worker, 0) + blocks
    return ExternalUse(used, sessions)
