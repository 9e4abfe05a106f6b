"""Flow control as pure code: which queued request a saturated pool starts next, and which it refuses.

The gateway (gateway/serving/flow_gate.py) holds requests between admission and placement
with it; the same code runs anywhere a clock and the pools' load views are at hand.

- Saturation, per pool, from the load view: a worker can start a request now while its
  estimated queue wait (queued prefill tokens / prefill speed) is under `max_engine_wait_s`,
  its engine holds fewer than `max_engine_waiting` requests waiting per DP rank and its KV
  usage is under `kv_usage_limit`. A pool with one such worker, and fewer than
  `max_engine_waiting` per DP rank of the requests this router placed still without a first
  token, is not saturated: the engines' own queues stay short and the ordering below decides
  who goes first. Flex leaves `flex_reserve` of that bound to the tiers above it, so a
  priority or default request finds room in the engines' queues rather than behind flex.
- Decode slots: flex requests hold at most `flex_max_share` of a pool's sequence slots (its
  engines' max_num_seqs x DP ranks), counted from their start to their end. Engines here
  neither prioritise nor preempt, so a request that finds every slot taken waits for one to
  finish; the share keeps slots free for the tiers above flex, whose requests then start at
  once however deep the flex backlog. With `flex_yield_window_s`, flex also leaves free as
  many slots as the tiers above held at most at once over the last window (`RecentPeak`):
  the reserve follows their demand, and flex takes every slot they leave.
  A pool whose slots are unknown has no such cap.
- Engines that preempt (a worker's info says `priority_preemption`; the gateway sends each
  request its tier as the engine's `priority`): flex has no slot cap there, since a request of
  a tier above preempts flex in the engine; such a request waits only for its own tiers' load
  (`preempting`): fewer of their requests starting than the bound, and of their held slots
  fewer than the pool's. Flex's queued work in the engines does not delay it.
- Bands: `priority` before `default` before `flex`; a lower band starts only when no higher
  band waits.
- Fair share within a band: start-time fair queuing by tokens. A tenant's request is tagged
  `start = max(V, the tenant's last finish)`, `finish = start + cost / weight` (cost: prompt
  plus expected output tokens); the least start tag goes first and V moves to it. A tenant
  flooding the band advances its own tags only, so another tenant's next request overtakes
  its backlog, and an agent's sessions share their tenant's tags. Routers that queue for the
  same pool and share a Redis keep one share instead (flow_share.py: least service over every
  router, and a router yields a start to another's request that should go first).
- Deadlines: each request has a TTFT target (its tier's, or the request's own). One that
  cannot start before it is refused on arrival with a Retry-After (the wait ahead of it:
  higher bands' and its own band's earlier tags, at the pool's drain rate), and one still
  queued at its deadline is refused then: always before any token was sent.
- Bounds: a pool's queue and a tenant's share of it are bounded. A full pool makes room by
  refusing the newest request of the lowest band below the arriving one (flex first,
  priority last); otherwise the arriving request is refused.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from enum import IntEnum, StrEnum
from typing import Protocol

from deepinfer_gateway.config import FlowControlSettings
from deepinfer_gateway.router.worker_view import WorkerView


class Tier(IntEnum):
    """A request's priority band; a lower value starts first."""

    PRIORITY = 0
    DEFAULT = 1
    FLEX = 2

    @property
    def label(self) -> str:
        return self.name.lower()

    @property
    def engine_priority(self) -> int:
        """The engines' `priority` (vLLM's: a lower value first, 0 by default): -1, 0, 1."""
        return int(self) - int(Tier.DEFAULT)


class ShedReason(StrEnum):
    """Why a request was refused (a bounded metrics label)."""

    DEADLINE = "deadline"  # could not start before its TTFT target
    QUEUE_FULL = "queue_full"  # the pool's queue was full of requests of its band or above
    TENANT_FULL = "tenant_full"  # its tenant's share of the pool's queue was full
    DISPLACED = "displaced"  # queued, then refused to make room for a request of a higher band


@dataclass(frozen=True)
class FlowLimits:
    max_engine_wait_s: float = 0.2
    max_engine_waiting: int = 4  # per DP rank
    kv_usage_limit: float = 0.95
    max_queued_per_pool: int = 1024
    max_queued_per_tenant: int = 256
    flex_reserve: int = 0  # of a pool's starting bound, kept for higher tiers (flex gets at least 1)
    flex_max_share: float = 1.0  # of a pool's sequence slots flex may hold (1: no cap)
    flex_yield_window_s: float = 0.0  # flex leaves the tiers above their recent peak (0: off)

    def flex_slots(self, slots: int, others_peak: int = 0) -> int | None:
        """Slots flex may hold in a pool of `slots` (0: unknown) whose tiers above flex held at most
        `others_peak` at once lately; None: no cap. Flex always gets one."""
        if slots <= 0 or (self.flex_max_share >= 1.0 and not self.flex_yield_window_s):
            return None
        cap = math.floor(self.flex_max_share * slots)
        if self.flex_yield_window_s:
            cap = min(cap, slots - others_peak)
        return max(1, cap)

    def flex_full(self, slots: int, flex_holding: int, others_peak: int) -> bool:
        """Whether flex holds all the slots it may (`flex_slots`)."""
        cap = self.flex_slots(slots, others_peak)
        return cap is not None and flex_holding >= cap

    @classmethod
    def of(cls, settings: FlowControlSettings) -> FlowLimits:
        return cls(max_engine_wait_s=settings.max_engine_wait_ms / 1000.0,
                   max_engine_waiting=settings.max_engine_waiting, kv_usage_limit=settings.kv_usage_limit,
                   max_queued_per_pool=settings.max_queued_per_pool,
                   max_queued_per_tenant=settings.max_queued_per_tenant, flex_reserve=settings.flex_reserve,
                   flex_max_share=settings.flex_max_share,
                   flex_yield_window_s=settings.flex_yield_window_ms / 1000.0)


@dataclass(frozen=True)
class WorkerLoad:
    wait_s: float  # queued prefill tokens / prefill tokens per second
    prefill_tokens_per_s: float
    waiting: int
    dp_ranks: int
    kv_usage: float

    def can_start(self, limits: FlowLimits) -> bool:
        return (self.wait_s < limits.max_engine_wait_s and self.waiting < limits.max_engine_waiting * self.dp_ranks
                and self.kv_usage < limits.kv_usage_limit)


@dataclass(frozen=True)
class PoolLoad:
    """A pool's workers as flow control sees them. `starting`: requests this router placed that have
    no first token yet (in an engine's queue or prefill): fresh where the reports' `waiting` is not,
    and the bound that holds when decoding, not prefill, is what the requests wait for.
    `slots`: the pool's sequence slots (0: unknown); `flex_holding`: flex requests this router
    started that have not ended; `others_peak`: the most requests of the tiers above held at once
    lately (`RecentPeak`). `preempts`: every worker preempts for a slot by priority (`preempting`), and
    `starting_above`, `held_above` are `starting` and the held slots of the tiers above flex."""

    workers: tuple[WorkerLoad, ...]
    starting: int = 0
    slots: int = 0
    flex_holding: int = 0
    others_peak: int = 0
    preempts: bool = False
    starting_above: int = 0
    held_above: int = 0

    def can_start(self, limits: FlowLimits, tier: Tier = Tier.DEFAULT) -> bool:
        """Whether a request of `tier` may start now: flex leaves `flex_reserve` of the starting bound
        and `1 - flex_max_share` of the slots to the tiers above it, so they need not queue behind
        flex in the engines. Where the engines preempt, the tiers above flex look only at their own
        requests and flex's slots have no cap (`preempting`)."""
        bound = limits.max_engine_waiting * sum(w.dp_ranks for w in self.workers)
        if self.preempts and tier is not Tier.FLEX:  # `preempting`: at least one worker
            return self.starting_above < bound and (not self.slots or self.held_above < self.slots)
        if tier is Tier.FLEX:
            bound = max(1, bound - limits.flex_reserve)
            if not self.preempts and limits.flex_full(self.slots, self.flex_holding, self.others_peak):
                return False
        return self.starting < bound and any(w.can_start(limits) for w in self.workers)

    @property
    def drain_tokens_per_s(self) -> float:
        return sum(w.prefill_tokens_per_s for w in self.workers)

    def wait_past(self, limits: FlowLimits) -> float:
        """Seconds until the least loaded worker's queue is back under the bound (0: now)."""
        if not self.workers:
            return math.inf
        return max(0.0, min(w.wait_s for w in self.workers) - limits.max_engine_wait_s)

    def placed(self, tokens: int, limits: FlowLimits, tier: Tier = Tier.DEFAULT) -> PoolLoad:
        """The load once `tokens` more are queued on the worker that can start them soonest: what a
        second placement in the same pass sees before any load report or booking shows the first."""
        startable = [i for i, w in enumerate(self.workers) if w.can_start(limits)] or list(range(len(self.workers)))
        if not startable:
            return self
        i = min(startable, key=lambda k: self.workers[k].wait_s)
        w = self.workers[i]
        moved = WorkerLoad(w.wait_s + tokens / w.prefill_tokens_per_s, w.prefill_tokens_per_s, w.waiting,
                           w.dp_ranks, w.kv_usage)
        above = tier is not Tier.FLEX
        return PoolLoad(self.workers[:i] + (moved,) + self.workers[i + 1:], self.starting + 1, self.slots,
                        self.flex_holding + (not above), self.others_peak, self.preempts,
                        self.starting_above + above, self.held_above + above)


def pool_slots(members: Sequence[WorkerView]) -> int:
    """The pool's sequence slots; 0 (unknown) if any member's are."""
    return 0 if any(not v.slots for v in members) else sum(v.slots for v in members)


def preempting(members: Sequence[WorkerView]) -> bool:
    """Every member preempts for a slot by priority: a request of a tier above flex preempts flex's running
    requests in the engine, so it waits for neither their slots nor their queue, and flex may hold
    every slot. What such a request waits for is its own tiers' load, as this router started it."""
    return bool(members) and all(v.preempts for v in members)


def pool_load(views: Iterable[WorkerView], pool: str, prefill_tokens_per_s: dict[str, float],
              granted_tokens: int = 0, starting: int = 0, flex_holding: int = 0, others_peak: int = 0,
              starting_above: int = 0, held_above: int = 0) -> PoolLoad:
    """`pool`'s load from the views; `granted_tokens`: placed by flow control and not yet in any
    view (no booking yet), spread over the pool's speed; `starting`, `flex_holding`, `others_peak`,
    `starting_above`, `held_above`: `PoolLoad`'s.
    `prefill_tokens_per_s`: by hardware."""
    members = [v for v in views if v.pool == pool]
    speed = sum(prefill_tokens_per_s[v.hardware] for v in members) or 1.0
    extra = granted_tokens / speed
    return PoolLoad(tuple(
        WorkerLoad(v.queued_prefill_tokens / prefill_tokens_per_s[v.hardware] + extra,
                   prefill_tokens_per_s[v.hardware], v.waiting, max(1, v.dp_ranks), v.kv_usage)
        for v in members), starting, pool_slots(members), flex_holding, others_peak, preempting(members),
        starting_above, held_above)


def can_start_now(views: Iterable[WorkerView], pool: str, prefill_tokens_per_s: dict[str, float],
                  limits: FlowLimits, granted_tokens: int = 0, starting: int = 0, tier: Tier = Tier.DEFAULT,
                  flex_holding: int = 0, others_peak: int = 0, starting_above: int = 0,
                  held_above: int = 0) -> bool:
    """`pool_load(...).can_start(limits, tier)` without building it, stopping at the first worker that
    can start: the unsaturated path's cost, paid by every request."""
    members = [v for v in views if v.pool == pool]
    if not members:
        return False
    if members[0].preempts and preempting(members):
        if tier is not Tier.FLEX:
            slots = pool_slots(members)
            return (starting_above < limits.max_engine_waiting * sum(max(1, v.dp_ranks) for v in members)
                    and (not slots or held_above < slots))
    elif tier is Tier.FLEX and flex_holding and limits.flex_full(pool_slots(members), flex_holding, others_peak):
        return False
    reserve = limits.flex_reserve if tier is Tier.FLEX else 0
    if starting >= max(1, limits.max_engine_waiting - reserve):  # else under the bound whatever the ranks
        bound = limits.max_engine_waiting * sum(max(1, v.dp_ranks) for v in members)
        if starting >= (max(1, bound - reserve) if tier is Tier.FLEX else bound):
            return False
    extra = granted_tokens / (sum(prefill_tokens_per_s[v.hardware] for v in members) or 1.0) if granted_tokens else 0.0
    return any(v.queued_prefill_tokens / prefill_tokens_per_s[v.hardware] + extra < limits.max_engine_wait_s
               and v.waiting < limits.max_engine_waiting * max(1, v.dp_ranks) and v.kv_usage < limits.kv_usage_limit
               for v in members)


class RecentPeak:
    """The most a count reached over the last window (to two): two buckets, O(1) per change."""

    __slots__ = ("window_s", "value", "_start", "_current", "_previous")

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.value = 0
        self._start = -math.inf
        self._current = self._previous = 0

    def add(self, delta: int, now: float) -> None:
        self._roll(now)
        self.value += delta
        self._current = max(self._current, self.value)

    def peak(self, now: float) -> int:
        self._roll(now)
        return max(self._previous, self._current)

    def _roll(self, now: float) -> None:
        if now - self._start >= self.window_s:
            self._previous = self._current if now - self._start < 2 * self.window_s else self.value
            self._current, self._start = self.value, now


class Holds:
    """What the requests flow control started hold in each pool: a place among the starting, from
    their start to their first token (`starting`; of which the tiers above flex, `starting_above`),
    and a sequence slot, from their start to their end: flex's count (against `flex_max_share`),
    the tiers above's count (`above`: what they wait for where the engines preempt) and, with a
    yield window, the tiers above's recent peak (`flex_yield_window_s`). The clock is the caller's."""

    def __init__(self, limits: FlowLimits) -> None:
        self.limits = limits
        self.starting: dict[str, int] = {}
        self.starting_above: dict[str, int] = {}
        self.flex: dict[str, int] = {}
        self.above: dict[str, int] = {}
        self._others: dict[str, RecentPeak] = {}

    def take(self, pool: str, tier: Tier, now: float) -> None:
        """A request started: it counts as starting and holds a slot."""
        self._starting(pool, tier, 1)
        self._slot(pool, tier, 1, now)

    def started(self, pool: str, tier: Tier) -> None:
        """Its first token (or its failure): no longer starting."""
        self._starting(pool, tier, -1)

    def release(self, pool: str, tier: Tier, now: float) -> None:
        """Its end: its slot is free."""
        self._slot(pool, tier, -1, now)

    def others_peak(self, pool: str, now: float) -> int:
        others = self._others.get(pool)
        return others.peak(now) if others is not None else 0

    def load(self, views: Iterable[WorkerView], pool: str, prefill_tokens_per_s: dict[str, float], now: float,
             granted_tokens: int = 0) -> PoolLoad:
        """`pool_load` with these holds."""
        return pool_load(views, pool, prefill_tokens_per_s, granted_tokens, self.starting.get(pool, 0),
                         self.flex.get(pool, 0), self.others_peak(pool, now), self.starting_above.get(pool, 0),
                         self.above.get(pool, 0))

    def _starting(self, pool: str, tier: Tier, delta: int) -> None:
        self.starting[pool] = self.starting.get(pool, 0) + delta
        if tier is not Tier.FLEX:
            self.starting_above[pool] = self.starting_above.get(pool, 0) + delta

    def _slot(self, pool: str, tier: Tier, delta: int, now: float) -> None:
        if tier is Tier.FLEX:
            self.flex[pool] = self.flex.get(pool, 0) + delta
            return
        self.above[pool] = self.above.get(pool, 0) + delta
        if self.limits.flex_yield_window_s:
            others = self._others.get(pool)
            if others is None:
                others = self._others[pool] = RecentPeak(self.limits.flex_yield_window_s)
            others.add(delta, now)


@dataclass(eq=False)
class FlowRequest:
    """One request under flow control. `handle`: the caller's (e.g. the waiter to wake)."""

    tenant: str
    tier: Tier
    prompt_tokens: int
    cost: int  # prompt + expected output tokens: the fair share's unit
    arrival: float
    deadline: float  # when it must have started (arrival + TTFT target)
    weight: float = 1.0
    handle: object = None
    start_tag: float = field(default=0.0, init=False)
    seq: int = field(default=0, init=False)
    queued: bool = field(default=False, init=False)
    starved: bool = field(default=False, init=False)  # refused at its deadline without a turn (`expired`)


@dataclass(frozen=True)
class Shed:
    reason: ShedReason
    retry_after_s: int


@dataclass(frozen=True)
class Arrival:
    """What became of an arriving request: `start` now, or queued (neither set), or `shed`;
    `displaced`: queued requests refused to make room for it."""

    start: bool = False
    shed: Shed | None = None
    displaced: tuple[FlowRequest, ...] = ()


class _Band:
    def __init__(self) -> None:
        self.heap: list[tuple[float, int, FlowRequest]] = []
        self.virtual = 0.0
        self.finish: dict[str, float] = {}  # tenant -> its last finish tag
        self.started_arrival: dict[str, float] = {}  # tenant -> the latest arrival among its started requests
        self.count = 0
        self.tokens = 0


class FairShare(Protocol):
    """A fair share kept with other routers that queue for the pool (flow_share.py's SharedShare)."""

    def pick(self, candidates: Iterable[FlowRequest], tier: Tier, now: float) -> FlowRequest | None: ...

    def served(self, request: FlowRequest, now: float) -> None: ...

    def waits_elsewhere(self, tier: Tier, now: float) -> bool: ...


class PoolQueue:
    """One pool's waiting requests (module doc). With `share`, the routers that queue for the pool keep
    one fair share (flow_share.py): a band starts the request its tenant's service over every router
    makes next, or none while another router should start first."""

    def __init__(self, limits: FlowLimits, share: FairShare | None = None) -> None:
        self.limits = limits
        self.share = share
        self.bands = [_Band() for _ in Tier]
        self.per_tenant: dict[str, int] = {}
        self._seq = itertools.count()
        self._drained: deque[tuple[float, int]] = deque()  # (when, tokens) started from a non-empty queue

    def __len__(self) -> int:
        return sum(b.count for b in self.bands)

    def depth(self, tier: Tier) -> int:
        return self.bands[tier].count

    def ahead_of(self, tier: Tier, now: float) -> bool:
        """Whether a request of `tier` or above waits, here or at another router sharing the pool: one
        of `tier` would start after it."""
        return (any(b.count for b in self.bands[:tier + 1])
                or (self.share is not None and self.share.waits_elsewhere(tier, now)))

    def arrive(self, request: FlowRequest, load: PoolLoad, now: float) -> Arrival:
        if not self.ahead_of(request.tier, now) and load.can_start(self.limits, request.tier):
            self.served(request, now)
            return Arrival(start=True)
        ahead = self.tokens_ahead(request)
        wait = load.wait_past(self.limits) + ahead / self.drain_rate(load, now)
        if now + wait > request.deadline:
            return Arrival(shed=Shed(ShedReason.DEADLINE, retry_after(wait)))
        if self.per_tenant.get(request.tenant, 0) >= self.limits.max_queued_per_tenant:
            return Arrival(shed=Shed(ShedReason.TENANT_FULL, retry_after(wait)))
        displaced: tuple[FlowRequest, ...] = ()
        if len(self) >= self.limits.max_queued_per_pool:
            victim = self._newest_below(request.tier)
            if victim is None:
                return Arrival(shed=Shed(ShedReason.QUEUE_FULL, retry_after(wait)))
            self.remove(victim)
            displaced = (victim,)
        self._push(request)
        return Arrival(displaced=displaced)

    def tokens_ahead(self, request: FlowRequest) -> int:
        """Tokens that start before `request` would: every higher band's, and those of its band
        tagged no later than it would be."""
        band = self.bands[request.tier]
        tag = max(band.virtual, band.finish.get(request.tenant, 0.0))
        return (sum(b.tokens for b in self.bands[:request.tier])
                + sum(r.prompt_tokens for t, _, r in band.heap if r.queued and t <= tag))

    def drain_rate(self, load: PoolLoad, now: float, window_s: float = 5.0) -> float:
        """Prompt tokens per second the pool takes from this queue: measured over the last
        `window_s` while it had a backlog, else the pool's prefill speed."""
        while self._drained and self._drained[0][0] < now - window_s:
            self._drained.popleft()
        if len(self._drained) >= 3:
            span = max(now - self._drained[0][0], 1e-3)
            return max(sum(t for _, t in self._drained) / span, 1.0)
        return max(load.drain_tokens_per_s, 1.0)

    def _push(self, request: FlowRequest) -> None:
        band = self.bands[request.tier]
        request.start_tag = max(band.virtual, band.finish.get(request.tenant, 0.0))
        band.finish[request.tenant] = request.start_tag + request.cost / request.weight
        request.seq = next(self._seq)
        request.queued = True
        heapq.heappush(band.heap, (request.start_tag, request.seq, request))
        band.count += 1
        band.tokens += request.prompt_tokens
        self.per_tenant[request.tenant] = self.per_tenant.get(request.tenant, 0) + 1

    def remove(self, request: FlowRequest) -> bool:
        """Take a queued request out (its client left, or it is refused); False if not queued.
        Its heap entry goes lazily."""
        if not request.queued:
            return False
        request.queued = False
        band = self.bands[request.tier]
        band.count -= 1
        band.tokens -= request.prompt_tokens
        left = self.per_tenant[request.tenant] - 1
        if left:
            self.per_tenant[request.tenant] = left
        else:
            del self.per_tenant[request.tenant]
        if not band.count:
            # An idle band forgets its tags: a tenant's history counts only while others wait.
            band.heap.clear()
            band.finish.clear()
            band.started_arrival.clear()
        return True

    def _newest_below(self, tier: Tier) -> FlowRequest | None:
        for band in reversed(self.bands[tier + 1:]):
            live = [r for _, _, r in band.heap if r.queued]
            if live:
                return max(live, key=lambda r: r.seq)
        return None

    def expired(self, now: float) -> list[FlowRequest]:
        """Queued requests whose deadline has passed, taken out (the caller refuses them); `starved`
        marks those that were their tenant's next in their band while requests of other tenants that
        arrived after them started: the tenant got no turn before the deadline."""
        late = []
        for band in self.bands:
            expiring = [r for _, _, r in band.heap if r.queued and r.deadline <= now]
            if not expiring:
                continue
            heads = {id(r) for r in self._heads(band)}
            for r in expiring:
                r.starved = id(r) in heads and any(arrival > r.arrival for tenant, arrival
                                                   in band.started_arrival.items() if tenant != r.tenant)
            late += expiring
        for r in late:
            self.remove(r)
        return late

    def next_start(self, load: PoolLoad, now: float) -> FlowRequest | None:
        """The request to start now, taken out; None while the pool is saturated or none waits."""
        if not len(self) or not load.can_start(self.limits):
            return None
        for tier, band in zip(Tier, self.bands, strict=True):
            if not band.count:
                continue
            if not load.can_start(self.limits, tier):
                return None  # flex, and only the higher tiers' reserve is left
            request = self._next_of(band) if self.share is None else self.share.pick(self._heads(band), tier, now)
            if request is None:
                return None  # another router starts first
            band.virtual = max(band.virtual, request.start_tag)
            band.started_arrival[request.tenant] = max(band.started_arrival.get(request.tenant, -math.inf),
                                                       request.arrival)
            self.remove(request)
            self._drained.append((now, request.prompt_tokens))
            self.served(request, now)
            return request
        return None

    def served(self, request: FlowRequest, now: float) -> None:
        """`request` starts (from the queue or at once): the shared fair share counts it."""
        if self.share is not None:
            self.share.served(request, now)

    def queued_by_tenant(self) -> dict[tuple[Tier, str], int]:
        """(band, tenant) -> requests waiting: what this router reports to the others."""
        counts: dict[tuple[Tier, str], int] = {}
        for tier, band in zip(Tier, self.bands, strict=True):
            for _, _, r in band.heap:
                if r.queued:
                    counts[tier, r.tenant] = counts.get((tier, r.tenant), 0) + 1
        return counts

    @staticmethod
    def _next_of(band: _Band) -> FlowRequest | None:
        """The least start tag: start-time fair queuing among this router's tenants."""
        while band.heap:
            _, _, request = band.heap[0]
            if request.queued:
                return request
            heapq.heappop(band.heap)
        return None

    @staticmethod
    def _heads(band: _Band) -> list[FlowRequest]:
        """Each tenant's next request in the band (least start tag)."""
        heads: dict[str, FlowRequest] = {}
        for _, _, r in band.heap:
            if r.queued:
                head = heads.get(r.tenant)
                if head is None or (r.start_tag, r.seq) < (head.start_tag, head.seq):
                    heads[r.tenant] = r
        return list(heads.values())


def retry_after(wait_s: float) -> int:
    """Retry-After seconds for an expected wait: at least 1."""
    return max(1, math.ceil(wait_s)) if math.isfinite(wait_s) else 60


class FlowPolicy:
    """Every pool's `PoolQueue`; `share_of(pool)` gives a pool its `FairShare`, for routers that keep one
    fair share with others."""

    def __init__(self, limits: FlowLimits, share_of: Callable[[str], FairShare] | None = None) -> None:
        self.limits = limits
        self.pools: dict[str, PoolQueue] = {}
        self._share_of = share_of

    def pool(self, name: str) -> PoolQueue:
        queue = self.pools.get(name)
        if queue is None:
            share = self._share_of(name) if self._share_of is not None else None
            queue = self.pools[name] = PoolQueue(self.limits, share)
        return queue

    def waiting_pools(self) -> list[str]:
        return [name for name, q in self.pools.items() if len(q)]

    def starts(self, pool: str, load: PoolLoad, now: float) -> list[FlowRequest]:
        """Every request `pool` can start now, in order, each seeing the load its predecessors add."""
        queue = self.pool(pool)
        started = []
        while (request := queue.next_start(load, now)) is not None:
            started.append(request)
            load = load.placed(request.prompt_tokens, self.limits, request.tier)
        return started


def resolve_tier(requested: str | None, ceiling: Tier, protocol_anthropic: bool = False) -> Tier:
    """The tier a request runs at: what it asked for (OpenAI `auto|default|flex|priority`,
    Anthropic `auto|standard_only`), never above its key's `ceiling` (which `auto` and an absent
    field get)."""
    if requested is None or requested == "auto":
        return ceiling
    if protocol_anthropic:  # standard_only: not priority capacity
        return max(ceiling, Tier.DEFAULT)
    asked = Tier[requested.upper()]
    return max(asked, ceiling)


def tier_of(name: str) -> Tier:
    return Tier[name.upper()]
