"""Route planning: which worker serves a request's prefill, and which its decode.

Pure (no I/O): the caller gathers `WorkerView`s (registry + load reports + in-flight
reservations) and the prefix index's `Overlap`, and gets back a `Plan`. The live gateway
and the offline simulator call this same code.

Modes:
- `unified`: no prefill/decode split configured (no healthy prefill or decode worker):
  one unified worker does both, chosen by the unified pool's policy.
- `pd`: a prefill worker (prefill pool policy, default estimated TTFT) computes the
  prompt and the first token; a decode worker with the same KV format (decode policy,
  default least load per DP rank) continues from the KV hand-off.
- `bypass`: the uncached part of the prompt on some decode worker is at most
  `pd_bypass_tokens`: that decode worker prefills it itself, skipping the hand-off.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from operator import attrgetter
from typing import Any, NamedTuple

from deepinfer_gateway.config import HardwareCost, RouterSettings
from deepinfer_gateway.config.policies import POLICIES, PolicyInput
from deepinfer_gateway.core.protocol import KV_BLOCK_TOKENS, Role
from deepinfer_gateway.kvcache.hashing import PrefixHasher, block_hashes, kv_salt
from deepinfer_gateway.kvcache.types import Overlap
from deepinfer_gateway.router.planner_caches import Group, PlannerCaches, PoolCandidates, RoleSplit
from deepinfer_gateway.router.policies import make_policy
from deepinfer_gateway.router.policy import Candidate, Decision, Lineage, Policy, Reason, RoutingView
from deepinfer_gateway.router.worker_view import WorkerView

__all__ = ["Mode", "NoCandidate", "Plan", "RoutePlanner", "WorkerView", "prompt_hashes"]


class Mode(StrEnum):
    """How a plan serves a request (module doc)."""

    UNIFIED = "unified"
    PD = "pd"
    BYPASS = "bypass"

    @property
    def first_role(self) -> Role:
        """The role its first leg's worker plays: a PD plan's prefills, the others serve it whole."""
        return Role.PREFILL if self is Mode.PD else Role.UNIFIED


@dataclass(frozen=True)
class Plan:
    mode: Mode
    worker: WorkerView  # first leg: the unified, prefill or (bypass) decode worker
    decision: Decision
    view: RoutingView
    # The policy's next choices after `worker` among the same candidates, best first
    # (`plan_first(fallbacks=n)`): where a data plane retries when `worker` cannot be reached.
    fallbacks: tuple[WorkerView, ...] = ()


class _Choice(NamedTuple):
    """A pool policy's pick, not yet observed: the planner ranks fallbacks from it first."""

    worker: WorkerView
    decision: Decision
    view: RoutingView
    policy: Policy
    members: Sequence[WorkerView]  # aligned with view.candidates


_FORMAT = attrgetter("kv_format")
_MODEL = attrgetter("model")
_POOL = attrgetter("pool")


class NoCandidate(Exception):
    """No healthy, compatible, untried worker for this leg."""


def prompt_hashes(token_ids: Sequence[int], workers: Iterable[WorkerView],
                  hasher: PrefixHasher | None = None, packed: bytes | None = None,
                  cache_salt: str | None = None) -> dict[str, list[int]]:
    """Chained block hashes of the prompt for every KV format among `workers` (salted per
    model+format, and by the request's `cache_salt` when it has one); `hasher` reuses the chains
    of recent prompts with the same beginning; `packed` is the prompt already packed
    (kvcache.hashing.pack_tokens), when known."""
    models = dict(zip(map(_FORMAT, workers), map(_MODEL, workers), strict=True))  # ~1,000 workers, few formats: C-level
    salts = {fmt: kv_salt(model, fmt, cache_salt) for fmt, model in models.items()}
    if hasher is None:
        return {fmt: block_hashes(token_ids, salt, packed=packed) for fmt, salt in salts.items()}
    return dict(zip(salts, hasher.hashes(token_ids, list(salts.values()), packed=packed), strict=True))


class RoutePlanner:
    def __init__(self, settings: RouterSettings, clock: Callable[[], float] = time.monotonic):
        """`clock`: what bookings time a request's scheduling on (router/booking.py); the simulator's is virtual."""
        self.settings = settings
        self.clock = clock
        self._policies: dict[str, Policy] = {}
        self._caches = PlannerCaches(self._base)  # kept across requests (planner_caches.py)

    def policy_for(self, pool: str, role: Role) -> Policy:
        if pool not in self._policies:
            default = self.settings.decode_policy if role is Role.DECODE else self.settings.policy
            config = self.settings.pool_policies.get(pool, default)
            affinity = self.settings.session_affinity if role is not Role.DECODE else None
            self._policies[pool] = make_policy(config, affinity)
        return self._policies[pool]

    def reconfigure(self, policy: PolicyInput | None = None, decode_policy: PolicyInput | None = None) -> None:
        """Switch the default policies at run time (admin API; `bench --sweep policy`), each
        given by name or as a table with parameters. An invalid one raises ValueError before
        anything changes; `pool_policies` overrides still win; every pool starts a fresh
        policy (round-robin positions, affinities)."""
        self.settings = self.settings.with_policies(policy, decode_policy)
        self._policies.clear()
        self._caches.clear()

    def describe(self) -> dict[str, Any]:
        """The routing policies in force, by name, with every parameter (admin API)."""
        s = self.settings
        return {"policy": s.policy.name, "decode_policy": s.decode_policy.name,
                "pool_policies": {pool: config.name for pool, config in s.pool_policies.items()},
                "parameters": s.model_dump(mode="json", include={"policy", "decode_policy", "pool_policies",
                                                                 "session_affinity"}),
                "available": list(POLICIES)}

    def hardware_cost(self, hardware: str) -> HardwareCost:
        return self.settings.hardware.get(hardware) or next(iter(self.settings.hardware.values()))

    def _base(self, w: WorkerView) -> Candidate:
        """The candidate for `w` with no cache hit."""
        cost = self.hardware_cost(w.hardware)
        return Candidate(
            worker_id=w.worker_id, hardware=w.hardware, pool=w.pool, kv_format=w.kv_format,
            queued_prefill_tokens=w.queued_prefill_tokens, running=w.running, dp_ranks=w.dp_ranks,
            admitting=w.admitting, admitting_tokens=w.admitting_tokens, admitting_max=w.admitting_max,
            prefilling_max=w.prefilling_max, prefilling_since=w.prefilling_since,
            prefill_tokens_per_s=cost.prefill_tokens_per_s, kv_load_bytes_per_s=cost.kv_load_bytes_per_s,
            kv_bytes_per_token=cost.kv_bytes_per_token,
        )

    def _choose(self, role: Role, workers: list[WorkerView], prompt_tokens: int, hashes: Mapping[str, list[int]],
                overlap: Overlap, session_key: str | None, lineage: Lineage | None = None) -> _Choice:
        # One policy per pool; with several pools of a role, the largest pool serves (pool choice
        # by cost across pools is future work: configure one pool per role for now).
        names = {w.pool for w in workers}
        if len(names) == 1:
            pool, members = names.pop(), workers
        else:
            pools: dict[str, list[WorkerView]] = {}
            for w in workers:
                pools.setdefault(w.pool, []).append(w)
            pool, members = max(pools.items(), key=lambda item: (len(item[1]), item[0]))
        return self._decide(role, pool, self._caches.pool(members, overlap), prompt_tokens, hashes, session_key,
                            lineage)

    def _choose_in(self, group: Group, live: Sequence[WorkerView], role: Role, prompt_tokens: int,
                   hashes: Mapping[str, list[int]], overlap: Overlap,
                   session_key: str | None, lineage: Lineage | None = None) -> _Choice:
        """`_choose` over a group of the view list: when it is one pool, its candidates redo only
        the members whose view changed since the group's last request."""
        if group.pool is None:
            return self._choose(role, [live[i] for i in group.indices], prompt_tokens, hashes, overlap, session_key,
                                lineage)
        return self._decide(role, group.pool, self._caches.group_pool(group, live, overlap), prompt_tokens, hashes,
                            session_key, lineage)

    def _decide(self, role: Role, pool: str, candidates: PoolCandidates, prompt_tokens: int,
                hashes: Mapping[str, list[int]], session_key: str | None,
                lineage: Lineage | None = None) -> _Choice:
        """The pool policy's choice among `candidates` (its members' views as of this request),
        not observed: `_settle` observes it once the fallbacks are ranked."""
        members = candidates.members
        fmt = members[0].kv_format
        view = RoutingView(
            prompt_tokens=prompt_tokens,
            candidates=candidates.candidates(),
            block_hashes=tuple(hashes.get(fmt, ())),
            block_tokens=KV_BLOCK_TOKENS,
            session_key=session_key,
            lineage=lineage,
            now=self.clock(),
            columns=candidates.columns(),
        )
        policy = self.policy_for(pool, role)
        decision = policy.choose(view)
        return _Choice(members[candidates.ids.index(decision.worker_id)], decision, view, policy, members)

    @staticmethod
    def _settle(mode: Mode, choice: _Choice, decision: Decision, fallbacks: int) -> Plan:
        """The plan of `choice`: its fallbacks ranked first, from the policy's state before this
        request, then the pick observed, once (a fallback is not where the request went)."""
        ranked = _ranked(choice, fallbacks) if fallbacks > 0 else ()
        choice.policy.observe(choice.view, choice.decision)
        return Plan(mode, choice.worker, decision, choice.view, ranked)

    def plan_first(self, workers: Sequence[WorkerView], prompt_tokens: int, hashes: Mapping[str, list[int]],
                   overlap: Overlap, session_key: str | None = None, exclude: frozenset[str] = frozenset(),
                   fallbacks: int = 0, lineage: Lineage | None = None) -> Plan:
        """The first leg's worker, and up to `fallbacks` more from the same ranking (`Plan.fallbacks`).
        `lineage`: the session's parent and the replicas' shared memory of both (session affinity).
        The policy observes the pick alone, once per call: call it again only for a request
        that really goes to another worker (a retry), never to list alternatives."""
        live = [w for w in workers if w.worker_id not in exclude] if exclude else workers
        split = self._caches.role_split(live)
        decode_formats = split.formats.get(Role.DECODE)
        if decode_formats and Role.PREFILL in split.formats:
            bypass = self._bypass_candidates(split, live, prompt_tokens, overlap)
            if bypass:
                choice = self._choose(Role.DECODE, bypass, prompt_tokens, hashes, overlap, session_key, lineage)
                decision = Decision(choice.decision.worker_id, Reason.BYPASS, choice.decision.costs,
                                    *self._predicted(choice.worker, prompt_tokens, overlap))
                return self._settle(Mode.BYPASS, choice, decision, fallbacks)
            prefill = split.group(Role.PREFILL, decode_formats)  # those a decode worker can continue
            if prefill.indices:
                choice = self._choose_in(prefill, live, Role.PREFILL, prompt_tokens, hashes, overlap, session_key,
                                         lineage)
                return self._settle(Mode.PD, choice, self._with_prediction(choice, prompt_tokens, overlap), fallbacks)
        unified = split.group(Role.UNIFIED)
        if unified.indices:
            choice = self._choose_in(unified, live, Role.UNIFIED, prompt_tokens, hashes, overlap, session_key,
                                     lineage)
            return self._settle(Mode.UNIFIED, choice, self._with_prediction(choice, prompt_tokens, overlap), fallbacks)
        raise NoCandidate("no healthy worker can serve this request")

    def first_pool(self, workers: Sequence[WorkerView], prompt_tokens: int, overlap: Overlap) -> str:
        """The pool `plan_first` would take the first leg's worker from, without asking (or telling)
        any policy: flow control queues a request by it before the request is planned."""
        pools: set[str] = set(map(_POOL, workers))
        if len(pools) == 1:  # the usual deployment: no role split to look at
            return pools.pop()
        split = self._caches.role_split(workers)
        decode_formats = split.formats.get(Role.DECODE)
        if decode_formats and Role.PREFILL in split.formats:
            bypass = self._bypass_candidates(split, workers, prompt_tokens, overlap)
            if bypass:
                return _largest_pool(bypass)
            prefill = split.group(Role.PREFILL, decode_formats)
            if prefill.indices:
                return _largest_pool([workers[i] for i in prefill.indices])
        unified = split.group(Role.UNIFIED)
        if unified.indices:
            return _largest_pool([workers[i] for i in unified.indices])
        raise NoCandidate("no healthy worker can serve this request")

    def plan_decode(self, workers: Sequence[WorkerView], kv_format: str, prompt_tokens: int,
                    exclude: frozenset[str] = frozenset()) -> tuple[WorkerView, Decision]:
        live = [w for w in workers if w.worker_id not in exclude] if exclude else workers
        decode = self._caches.role_split(live).group(Role.DECODE, (kv_format,))
        if not decode.indices:
            raise NoCandidate(f"no healthy decode worker with KV format {kv_format}")
        choice = self._choose_in(decode, live, Role.DECODE, prompt_tokens, {}, Overlap(), None)
        choice.policy.observe(choice.view, choice.decision)
        return choice.worker, choice.decision

    def _bypass_candidates(self, split: RoleSplit, live: Sequence[WorkerView], prompt_tokens: int,
                           overlap: Overlap) -> list[WorkerView]:
        limit = self.settings.pd_bypass_tokens
        if limit <= 0:
            return []
        # Nobody qualifies unless the longest hit anywhere does (one pass in C, not one per worker).
        best = max(max(overlap.memory.values(), default=0), max(overlap.store.values(), default=0))
        if prompt_tokens - min(best * KV_BLOCK_TOKENS, prompt_tokens) > limit:
            return []
        out = []
        for w in (w for w in split.members(live, Role.DECODE) if w.prefills):
            cached = max(overlap.memory.get(w.worker_id, 0), overlap.store.get(w.kv_format, 0)) * KV_BLOCK_TOKENS
            if prompt_tokens - min(cached, prompt_tokens) <= limit:
                out.append(w)
        return out

    @staticmethod
    def _predicted(w: WorkerView, prompt_tokens: int, overlap: Overlap) -> tuple[int, int]:
        mem = min(overlap.memory.get(w.worker_id, 0) * KV_BLOCK_TOKENS, prompt_tokens)
        store = max(0, min(overlap.store.get(w.kv_format, 0) * KV_BLOCK_TOKENS, prompt_tokens) - mem)
        return mem, store

    def _with_prediction(self, choice: _Choice, prompt_tokens: int, overlap: Overlap) -> Decision:
        """Every policy's decision carries the index's prediction for the chosen worker (honesty metrics)."""
        mem, store = self._predicted(choice.worker, prompt_tokens, overlap)
        decision = choice.decision
        return Decision(decision.worker_id, decision.reason, decision.costs, mem, store)


def _largest_pool(workers: Sequence[WorkerView]) -> str:
    """The pool `_choose` serves from: the one with most members (then the greatest name)."""
    sizes: dict[str, int] = {}
    for w in workers:
        sizes[w.pool] = sizes.get(w.pool, 0) + 1
    return max(sizes.items(), key=lambda item: (item[1], item[0]))[0]


def _ranked(choice: _Choice, n: int) -> tuple[WorkerView, ...]:
    """Up to `n` more workers after the pick, each the policy's choice among the candidates not
    yet ranked (`choose` alone, which changes no state)."""
    view = choice.view
    left = dict(zip((c.worker_id for c in view.candidates), zip(view.candidates, choice.members, strict=True),
                    strict=True))
    del left[choice.decision.worker_id]
    ranked: list[WorkerView] = []
    while left and len(ranked) < n:
        rest = RoutingView(prompt_tokens=view.prompt_tokens, candidates=tuple(c for c, _ in left.values()),
                           block_hashes=view.block_hashes, block_tokens=view.block_tokens,
                           session_key=view.session_key, lineage=view.lineage, now=view.now)
        ranked.append(left.pop(choice.policy.choose(rest).worker_id)[1])
    return tuple(ranked)
