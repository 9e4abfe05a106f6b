"""Routing policies, all behind `Policy.choose(view) -> Decision` (router/policy.py).

| policy           | uses                                 | choose it when                                   |
|------------------|--------------------------------------|--------------------------------------------------|
| round_robin      | nothing                              | baseline; identical stateless workers            |
| least_load       | queued prefill tokens, running seqs  | no prefix reuse in the workload                  |
| power_of_two     | load of two random candidates        | many gateways, stale load reports                |
| prefix_approx    | this gateway's own routing history   | no KV events from engines (SGLang router's way)  |
| cache_aware      | KV index overlap (memory tier)       | prefix reuse, homogeneous hardware               |
| estimated_ttft   | overlap per tier, queue, hw speed    | default: mixed SM100/Ascend, tiered KV           |

Estimated TTFT of a candidate (seconds), from the view only:

    mem   = min(memory_hit_blocks * B, P)                  tokens already in its memory
    store = max(0, min(store_hit_blocks * B, P) - mem)     tokens it can load from the store
    ttft  = queued_prefill_tokens / prefill_tokens_per_s   queue wait (all DP ranks drain it)
          + (P - mem - store) / (prefill_tokens_per_s / dp_ranks)   its own prefill, on one rank
          + store * kv_bytes_per_token / kv_load_bytes_per_s        KV load at store bandwidth

P = prompt tokens, B = 128-token blocks.

Lockstep (`lockstep`, off by default: docs/policies.md weighs it). A worker's DP ranks step
together: a step lasts as long as its largest prefill chunk, and a request sent now joins the
step after the one under way, with the requests sent there before it and not yet scheduled
(`admitting` = n of them, A tokens uncached in all, the largest M; router/booking.py). Each
request's chunk sits whole on one rank, so a step's busiest rank holds L(n, A, M) = max(M,
ceil(n / dp_ranks) * A / n) tokens. With U = P - mem - store, its own part, S the largest
uncached part the worker scheduled and has not answered yet (the step under way), every chunk
at most `step_tokens` (a rank's budget per step), and r one rank's speed (prefill_tokens_per_s
/ dp_ranks):

    ttft = queue wait for all but the n
         + L(n + 1, A + U, max(M, U)) / r               then its own step, as long as its busiest rank
         (+ the rest of U past step_tokens, + KV load)
    pick by ttft + n * (L(n + 1, ...) - L(n, A, M)) / r   ...which it lengthens for each of the n

With `lockstep_under_way` the queue wait is at least what is left of the step under way (S / r
less the time since the last of them was scheduled; off by default: it moves conversation turns
off the worker holding their history, docs/policies.md).

Without the added pick term, a burst of requests that share a prompt (agent sessions starting
together) follow its first one as hits while a cold prompt of another kind, as cheap there as
anywhere on its own estimate, joins their step and holds every one of them for its prefill.

Two adjustments on top of the cheapest candidate:
- Stickiness: the candidate holding the longest memory prefix is kept unless its cost
  exceeds `stick_ratio` x the cheapest + `stick_s` (default 1.5x + 50 ms). The formula
  prices only this request; moving a conversation off the worker that holds its history
  also costs every later turn (measured on the Mooncake trace: docs/policies.md).
- Guard: when the pick's queue exceeds `guard_ratio` x the mean queue + `guard_tokens`,
  the cheapest candidate under that bound wins instead (reason load_fallback), so a stale
  load report cannot pile a popular prefix onto one worker.

Each policy's parameters and their defaults are its variant in config/policies.py;
`make_policy` builds a policy from one.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from itertools import compress, repeat
from operator import add, and_, attrgetter, eq, le
from typing import assert_never

from deepinfer_gateway.config.policies import (
    CacheAwareConfig,
    EstimatedTtftConfig,
    LeastLoadConfig,
    PolicyInput,
    PowerOfTwoConfig,
    PrefixApproxConfig,
    RoundRobinConfig,
    SessionAffinityConfig,
    parse_policy,
)
from deepinfer_gateway.router.policy import (
    Candidate,
    Columns,
    Decision,
    LazyCosts,
    Policy,
    Reason,
    RoutingView,
    columns_of,
)


def estimated_ttft_s(c: Candidate, view: RoutingView) -> tuple[float, int, int]:
    """(seconds, predicted memory-tier tokens, predicted store-tier tokens) for candidate c."""
    return estimated_ttfts((c,), view)[0]


def estimated_ttfts(candidates: Sequence[Candidate], view: RoutingView) -> list[tuple[float, int, int]]:
    """`estimated_ttft_s` of each candidate."""
    table = columns_of(candidates)
    keys, terms = _estimate_terms(table, view)
    seconds = _estimates(table, keys, terms)
    return [(s, terms[k][2], terms[k][3]) for s, k in zip(seconds, keys, strict=True)]


_Terms = dict[tuple[int, int, int], tuple[float, float, int, int]]


def _estimate_terms(table: Columns, view: RoutingView) -> tuple[list[tuple[int, int, int]], _Terms]:
    """Each candidate's (memory hits, store hits, profile) key, and per distinct key
    (own prefill s, KV load s, mem tokens, store tokens). A fleet pool has hundreds of
    candidates and few distinct combinations: the terms are computed once per combination."""
    prompt, block = view.prompt_tokens, view.block_tokens
    keys = list(zip(table.hits, table.stored, table.profiles, strict=True))
    terms = {}
    for key in set(keys):
        hits, stored, profile = key
        dp_ranks, prefill_tokens_per_s, kv_bytes_per_token, kv_load_bytes_per_s = table.profile_values[profile]
        mem = min(hits * block, prompt)
        store = max(0, min(stored * block, prompt) - mem)
        terms[key] = (
            (prompt - mem - store) * max(1, dp_ranks) / prefill_tokens_per_s,  # its own prefill, on one rank
            store * kv_bytes_per_token / kv_load_bytes_per_s,  # KV load at store bandwidth
            mem, store,
        )
    return keys, terms


def _estimates(table: Columns, keys: list[tuple[int, int, int]], terms: _Terms) -> list[float]:
    """Seconds per candidate: queue wait + own prefill + KV load, summed in that order."""
    prefill = {key: t[0] for key, t in terms.items()}
    load = {key: t[1] for key, t in terms.items()}
    return list(map(add, map(add, table.waits, map(prefill.__getitem__, keys)), map(load.__getitem__, keys)))


def _with_lockstep(table: Columns, keys: list[tuple[int, int, int]], terms: _Terms, seconds: list[float],
                   prompt: int, step_tokens: int, now: float | None) -> list[float]:
    """The lockstep terms (module doc): each candidate's estimate in `seconds` becomes its queue
    (with `now`: at least the step under way's rest) plus its next step's length, in place;
    returned, the costs to pick by, which add what its chunk lengthens that step for the
    requests admitting there. Only candidates with requests admitting or scheduled differ."""
    crowds = table.crowds
    busy = list(compress(range(len(crowds)), map(any, crowds)))
    if not busy:
        return seconds
    costs = list(seconds)
    profile_values, profiles, waits = table.profile_values, table.profiles, table.waits
    for i in busy:
        admitting, tokens, largest, under_way, since = crowds[i]
        dp_ranks, prefill_tokens_per_s = profile_values[profiles[i]][:2]
        dp_ranks = max(1, dp_ranks)
        per_token = dp_ranks / prefill_tokens_per_s  # one rank's seconds per token
        _, _, mem, store = terms[keys[i]]
        own = prompt - mem - store
        chunk = min(own, step_tokens)
        capped, largest = min(tokens, admitting * step_tokens), min(largest, step_tokens)
        before = _rank_load(admitting, capped, largest, dp_ranks)
        after = _rank_load(admitting + 1, capped + chunk, max(largest, chunk), dp_ranks)
        rest = max(0.0, waits[i] - tokens / prefill_tokens_per_s)  # the queue but the requests admitting
        if now is not None:
            rest = max(rest, _step_left(under_way, since, now, step_tokens, per_token))
        estimate = rest + (after + own - chunk) * per_token
        delta = estimate - (waits[i] + own * per_token)
        seconds[i] += delta
        costs[i] += delta + admitting * (after - before) * per_token
    return costs


def _step_left(under_way: int, since: float, now: float, step_tokens: int, per_token: float) -> float:
    """Seconds left of the step under way: its largest prefill's chunk, begun when the last request
    was scheduled (`since`), or the next chunk of a prefill longer than one step."""
    if not under_way:
        return 0.0
    step = min(under_way, step_tokens) * per_token
    elapsed = max(0.0, now - since)
    return step - elapsed % step if under_way > step_tokens else max(0.0, step - elapsed)


def _rank_load(requests: int, tokens: int, largest: int, dp_ranks: int) -> float:
    """Prefill tokens on a step's busiest rank, `requests` chunks of `tokens` in all spread over the
    ranks whole (the engines place a request on one rank), the largest `largest`."""
    if not requests:
        return 0.0
    return max(largest, -(-requests // dp_ranks) * tokens / requests)


def _cheapest(seconds: list[float], ids: list[str], among: Iterable[bool] | None = None) -> int | None:
    """Index of the first candidate in (seconds, worker id, index) order, among those `among`
    selects. Float passes (min, count) first: the ids break ties only."""
    if among is None:
        selected: list[int] | range = range(len(seconds))
        costs = seconds
    else:
        selected = list(compress(range(len(seconds)), among))
        if not selected:
            return None
        costs = list(map(seconds.__getitem__, selected))
    least = min(costs)
    if costs.count(least) == 1:
        return selected[costs.index(least)]
    return min(compress(selected, map(eq, costs, repeat(least))), key=ids.__getitem__)


def least_load_index(table: Columns) -> int:
    """Index of the candidate first in (queued prefill tokens, running, worker id, index) order."""
    queues = table.queues
    least = min(queues)
    if queues.count(least) == 1:
        return queues.index(least)
    at_least = list(map(eq, queues, repeat(least)))  # decode pools: most queues are 0
    fewest = min(compress(table.running, at_least))
    tied = list(compress(range(len(queues)), map(and_, at_least, map(eq, table.running, repeat(fewest)))))
    return tied[0] if len(tied) == 1 else min(tied, key=table.ids.__getitem__)


_load_key: Callable[[Candidate], tuple[int, int, str]] = attrgetter("queued_prefill_tokens", "running", "worker_id")


class RoundRobin:
    """Cycles through candidates; ignores cache and load."""

    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, view: RoutingView) -> Decision:
        ordered = sorted(view.candidates, key=lambda c: c.worker_id)
        chosen = ordered[self._next % len(ordered)]
        return Decision(chosen.worker_id, Reason.ROUND_ROBIN)

    def observe(self, view: RoutingView, decision: Decision) -> None:
        self._next += 1  # the turn passes when a request goes, not when a fallback is ranked


class LeastLoad:
    """Fewest queued prefill tokens, then fewest running sequences."""

    name = "least_load"

    def choose(self, view: RoutingView) -> Decision:
        table = view.table()
        return Decision(table.ids[least_load_index(table)], Reason.LEAST_LOAD)

    def observe(self, view: RoutingView, decision: Decision) -> None:
        pass


class PowerOfTwo:
    """The least loaded of `choices` (two) random candidates: robust to stale load without herding."""

    name = "power_of_two"

    def __init__(self, config: PowerOfTwoConfig = PowerOfTwoConfig()) -> None:
        self.choices = config.choices
        self._rng = random.Random(config.seed)

    def choose(self, view: RoutingView) -> Decision:
        # The draw leaves the generator as it was: only `observe` moves it on, so ranking
        # fallbacks does not change the next request's draw (a seeded run stays the same).
        rng = self._rng
        state = rng.getstate()
        drawn = rng.sample(view.candidates, min(self.choices, len(view.candidates)))
        rng.setstate(state)
        return Decision(min(drawn, key=_load_key).worker_id, Reason.POWER_OF_TWO)

    def observe(self, view: RoutingView, decision: Decision) -> None:
        n = len(view.candidates)
        self._rng.sample(range(n), min(self.choices, n))  # the draw `choose` made: its size alone sets what it takes


class _OverlapThenLoad:
    """SGLang's cache-aware rule: balance when imbalanced, else the longest prefix match
    (if it covers at least `min_match` of the prompt), else the least loaded."""

    def __init__(self, overlap: Callable[[Candidate, RoutingView], int],
                 config: CacheAwareConfig | PrefixApproxConfig):
        self._overlap = overlap
        self.balance_abs_tokens = config.balance_abs_tokens
        self.balance_rel = config.balance_rel
        self.min_match = config.min_match

    def decide(self, view: RoutingView) -> Decision:
        loads = [c.queued_prefill_tokens for c in view.candidates]
        if max(loads) - min(loads) > self.balance_abs_tokens and max(loads) > self.balance_rel * min(loads):
            return Decision(min(view.candidates, key=_load_key).worker_id, Reason.LOAD_FALLBACK)
        blocks = {c.worker_id: self._overlap(c, view) for c in view.candidates}
        best = max(view.candidates, key=lambda c: (blocks[c.worker_id], -c.queued_prefill_tokens, c.worker_id))
        matched = blocks[best.worker_id] * view.block_tokens
        if view.prompt_tokens and matched / view.prompt_tokens >= self.min_match:
            return Decision(best.worker_id, Reason.PREFIX_HIT, predicted_memory_tokens=min(matched, view.prompt_tokens))
        return Decision(min(view.candidates, key=_load_key).worker_id, Reason.LEAST_LOAD)


class CacheAware:
    """Precise memory-tier overlap from the KV index (engine KV events)."""

    name = "cache_aware"

    def __init__(self, config: CacheAwareConfig = CacheAwareConfig()) -> None:
        self._rule = _OverlapThenLoad(lambda c, view: c.memory_hit_blocks, config)

    def choose(self, view: RoutingView) -> Decision:
        return self._rule.decide(view)

    def observe(self, view: RoutingView, decision: Decision) -> None:
        pass


class PrefixApprox:
    """The gateway's own record of which worker it sent each block chain to; no engine
    feedback (what SGLang's router does with its radix tree). Bounded: `capacity` block
    hashes, least recently routed evicted first."""

    name = "prefix_approx"

    def __init__(self, config: PrefixApproxConfig = PrefixApproxConfig()) -> None:
        self._where: OrderedDict[int, str] = OrderedDict()
        self.capacity = config.capacity
        self._rule = _OverlapThenLoad(self._overlap, config)

    def _overlap(self, c: Candidate, view: RoutingView) -> int:
        n = 0
        for h in view.block_hashes:
            if self._where.get(h) != c.worker_id:
                break
            n += 1
        return n

    def choose(self, view: RoutingView) -> Decision:
        return self._rule.decide(view)

    def observe(self, view: RoutingView, decision: Decision) -> None:
        where = self._where
        for h in reversed(view.block_hashes):  # prefix blocks end up most recent: evicted last
            where[h] = decision.worker_id
            where.move_to_end(h)
        while len(where) > self.capacity:
            where.popitem(last=False)


class EstimatedTtft:
    """Minimum estimated TTFT (module docstring), sticky to the longest memory prefix, with a
    load-balance guard."""

    name = "estimated_ttft"

    def __init__(self, config: EstimatedTtftConfig = EstimatedTtftConfig()) -> None:
        self.lockstep = config.lockstep
        self.step_tokens = config.step_tokens
        self.under_way = config.lockstep_under_way
        self.guard_ratio = config.guard_ratio
        self.guard_tokens = config.guard_tokens
        self.stick_ratio = config.stick_ratio
        self.stick_s = config.stick_s

    def choose(self, view: RoutingView) -> Decision:
        # Candidates rank by (seconds, worker id); each pick below is the first in that order
        # among some candidates: a min() over C-level passes of the columns, no sort and no
        # Python loop per candidate (a fleet pool has hundreds per request).
        table = view.table()
        keys, terms = _estimate_terms(table, view)
        seconds = _estimates(table, keys, terms)
        costs = (_with_lockstep(table, keys, terms, seconds, view.prompt_tokens, self.step_tokens,
                                view.now if self.under_way else None) if self.lockstep else seconds)
        ids, hits, queues = table.ids, table.hits, table.queues
        first = _cheapest(costs, ids)
        assert first is not None  # candidates are never empty
        most = max(hits)
        holder = first if hits[first] == most else _cheapest(costs, ids, map(eq, hits, repeat(most)))
        assert holder is not None
        bound = self.guard_ratio * (sum(queues) / len(queues)) + self.guard_tokens
        chosen, reason = first, None
        if hits[holder] > hits[first] and costs[holder] <= self.stick_ratio * costs[first] + self.stick_s:
            chosen = holder
        if queues[chosen] > bound:
            under = _cheapest(costs, ids, map(le, queues, repeat(bound)))
            if under is not None:
                chosen, reason = under, Reason.LOAD_FALLBACK
        _, _, mem, store = terms[keys[chosen]]
        if reason is None:
            if hits[chosen] < hits[holder]:
                reason = Reason.QUEUE_OVER_CACHE
            else:
                reason = Reason.PREFIX_HIT if mem else Reason.STORE_HIT if store else Reason.COLD
        return Decision(ids[chosen], reason, LazyCosts(ids, seconds), predicted_memory_tokens=mem,
                        predicted_store_tokens=store)

    def observe(self, view: RoutingView, decision: Decision) -> None:
        pass


class SessionAffinity:
    """Keeps a session on its last worker while that worker's queue stays under
    `max_queue_tokens`, and a subagent's first request on its parent's worker while that queue
    stays under `lineage_max_queue_tokens`; otherwise defers to `inner`. Where the view carries
    a shared store's memory (`Lineage.shared`: every gateway replica's), that wins over this
    process's own."""

    def __init__(self, inner: Policy, config: SessionAffinityConfig = SessionAffinityConfig(enabled=True)):
        self.inner = inner
        self.name = inner.name
        self.max_queue_tokens = config.max_queue_tokens
        self.lineage_max_queue_tokens = config.lineage_max_queue_tokens
        self.capacity = config.capacity
        self._sessions: OrderedDict[str, str] = OrderedDict()

    def _target(self, view: RoutingView) -> tuple[str | None, int, Reason]:
        """The worker to keep the request on, the queue bound that lets it stay, and why."""
        lineage = view.lineage
        shared = lineage is not None and lineage.shared
        own = lineage.session_worker if shared and lineage is not None else None
        if own is None and view.session_key:
            own = self._sessions.get(view.session_key)
        if own is not None:
            return own, self.max_queue_tokens, Reason.AFFINITY
        if lineage is None or lineage.parent_key is None:
            return None, 0, Reason.AFFINITY
        parent = lineage.parent_worker if shared else None
        if parent is None:
            parent = self._sessions.get(lineage.parent_key)
        return parent, self.lineage_max_queue_tokens, Reason.LINEAGE

    def choose(self, view: RoutingView) -> Decision:
        worker, bound, reason = self._target(view)
        if worker is None:
            return self.inner.choose(view)
        for c in view.candidates:
            if c.worker_id == worker and c.queued_prefill_tokens <= bound:
                inner = self.inner.choose(view)
                if inner.worker_id == worker:
                    return inner
                return Decision(worker, reason, inner.costs)
        return self.inner.choose(view)

    def observe(self, view: RoutingView, decision: Decision) -> None:
        self.inner.observe(view, decision)
        if view.session_key:
            self._sessions[view.session_key] = decision.worker_id
            self._sessions.move_to_end(view.session_key)
            if len(self._sessions) > self.capacity:
                self._sessions.popitem(last=False)


def make_policy(config: PolicyInput, affinity: SessionAffinityConfig | None = None) -> Policy:
    """The policy a config variant describes (a name or table is validated first: ValueError),
    wrapped in session affinity when `affinity` is enabled."""
    config = parse_policy(config)
    policy: Policy
    match config:
        case RoundRobinConfig():
            policy = RoundRobin()
        case LeastLoadConfig():
            policy = LeastLoad()
        case PowerOfTwoConfig():
            policy = PowerOfTwo(config)
        case PrefixApproxConfig():
            policy = PrefixApprox(config)
        case CacheAwareConfig():
            policy = CacheAware(config)
        case EstimatedTtftConfig():
            policy = EstimatedTtft(config)
        case _:
            assert_never(config)
    return SessionAffinity(policy, affinity) if affinity is not None and affinity.enabled else policy
