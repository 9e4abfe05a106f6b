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

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from itertools import compress, repeat
from operator import attrgetter, is_not
from typing import Any

from deepinfer_gateway.config import HardwareCost, RouterSettings
from deepinfer_gateway.kvcache.hashing import PrefixHasher, block_hashes, kv_salt
from deepinfer_gateway.kvcache.types import Overlap
from deepinfer_gateway.protocol import KV_BLOCK_TOKENS, Role
from deepinfer_gateway.router.policies import make_policy
from deepinfer_gateway.router.policy import (
    PROFILE,
    Candidate,
    Columns,
    Decision,
    Policy,
    Reason,
    RoutingView,
)
from deepinfer_gateway.router.policy_config import POLICIES, PolicyInput


@dataclass(frozen=True)
class WorkerView:
    worker_id: str
    role: Role
    pool: str
    hardware: str
    kv_format: str
    model: str
    queued_prefill_tokens: int = 0
    running: int = 0
    dp_ranks: int = 1
    prefills: bool = True  # a decode worker that can take a PD bypass


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


# `Candidate(**fields)` without the frozen dataclass's per-field object.__setattr__: the same
# object as long as Candidate keeps a plain __dict__ and has no __post_init__.
assert not hasattr(Candidate, "__slots__") and not hasattr(Candidate, "__post_init__")
_new_object = object.__new__
_FORMAT = attrgetter("kv_format")
_MODEL = attrgetter("model")
_KEEP_PROFILES = 256  # distinct hardware profiles a pool interns before starting afresh
_KEEP_POOLS = 64  # member lists whose candidates are kept


def _with_hits(base: Candidate, memory_hit_blocks: int, store_hit_blocks: int) -> Candidate:
    c = _new_object(Candidate)
    fields = c.__dict__
    fields.update(base.__dict__)
    fields["memory_hit_blocks"] = memory_hit_blocks
    fields["store_hit_blocks"] = store_hit_blocks
    return c


class _Candidates(Sequence[Candidate]):
    """A pool's candidates for one request, built when first read: the default policies read
    the planner's columns only, and a fleet request changes hundreds of members' hits."""

    __slots__ = ("_bases", "_hits", "_stored", "_built")

    def __init__(self, bases: list[Candidate], hits: list[int], stored: list[int]) -> None:
        self._bases, self._hits, self._stored = bases, hits, stored
        self._built: tuple[Candidate, ...] | None = None

    def _all(self) -> tuple[Candidate, ...]:
        if self._built is None:
            self._built = tuple(_with_hits(base, mem, stored) if mem or stored else base
                                for base, mem, stored in zip(self._bases, self._hits, self._stored, strict=True))
        return self._built

    def __getitem__(self, i: Any) -> Any:
        return self._all()[i]

    def __len__(self) -> int:
        return len(self._bases)

    def __iter__(self) -> Iterator[Candidate]:
        return iter(self._all())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, _Candidates | tuple):
            return self._all() == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._all())

    def __repr__(self) -> str:
        return repr(self._all())


class _PoolCandidates:
    """One pool's candidates across requests, as columns (router/policy.py `Columns`) updated
    in place: from one request to the next only a few views change (a load report, a
    reservation), so a request costs a few C-level passes over the pool (which views
    differ, the hits per member) plus Python work for the changed views only."""

    def __init__(self, planner: RoutePlanner, members: Sequence[WorkerView]) -> None:
        n = len(members)
        self.planner = planner
        self.members = list(members)
        self.bases = [planner._base(w) for w in members]  # each member's candidate with no hit
        self.ids = [w.worker_id for w in members]
        self.formats = [w.kv_format for w in members]
        self.hits = [0] * n  # replaced, never changed in place: snapshots share them
        self.stored = [0] * n  # same
        self.store: Mapping[str, int] = {}
        self.queues = [c.queued_prefill_tokens for c in self.bases]
        self.running = [c.running for c in self.bases]
        self.waits = [c.queued_prefill_tokens / c.prefill_tokens_per_s for c in self.bases]
        self.profile_values: list[tuple[Any, ...]] = []
        self.profile_of: dict[tuple[Any, ...], int] = {}
        self.profiles = [self._profile(c) for c in self.bases]

    def _profile(self, c: Candidate) -> int:
        value = PROFILE(c)
        key = self.profile_of.get(value)
        if key is None:
            key = self.profile_of[value] = len(self.profile_values)
            self.profile_values.append(value)
        return key

    def update(self, members: Sequence[WorkerView], overlap: Overlap) -> bool:
        """Take this request's views and overlap; False when the members are not the same
        workers in the same order (the caller starts afresh)."""
        n = len(members)
        if n != len(self.members) or len(self.profile_values) > _KEEP_PROFILES:
            return False
        changed = []
        for i in compress(range(n), map(is_not, members, self.members)):
            w, before = members[i], self.members[i]
            if w.worker_id != before.worker_id:
                return False
            self.members[i] = w
            if w != before:
                changed.append(i)
        self._take(changed, overlap)
        return True

    def refresh(self, views: Sequence[WorkerView], at: Mapping[int, int], dirty: Iterable[int],
                overlap: Overlap) -> bool:
        """`update(members, overlap)`, where member k is `views[i]` for `at[i] == k`, when the
        members' views can differ from the last ones only at positions `dirty` of `views`
        and every position keeps its worker; False when the caller must start afresh."""
        if len(self.profile_values) > _KEEP_PROFILES:
            return False
        members = self.members
        changed = []
        for i in sorted(dirty):  # `at` keeps the list order: member positions come out ascending
            k = at.get(i)
            if k is None:
                continue
            w, before = views[i], members[k]
            if w is not before:
                members[k] = w
                if w != before:
                    changed.append(k)
        self._take(changed, overlap)
        return True

    def _take(self, changed: list[int], overlap: Overlap) -> None:
        """Redo the members at `changed` (ascending) and take this request's overlap."""
        n = len(self.members)
        for i in changed:
            w = self.members[i]
            base = self.bases[i] = self.planner._base(w)
            self.formats[i] = w.kv_format
            self.queues[i] = base.queued_prefill_tokens
            self.running[i] = base.running
            self.waits[i] = base.queued_prefill_tokens / base.prefill_tokens_per_s
            self.profiles[i] = self._profile(base)
        memory, store = overlap.memory, overlap.store
        if memory:
            self.hits = list(map(memory.get, self.ids, repeat(0)))
        elif any(self.hits):
            self.hits = [0] * n
        if store != self.store:
            self.stored = list(map(store.get, self.formats, repeat(0))) if store else [0] * n
            self.store = dict(store)
        elif changed and store:
            stored = self.stored = list(self.stored)
            for i in changed:
                stored[i] = store.get(self.formats[i], 0)

    def candidates(self) -> _Candidates:
        return _Candidates(list(self.bases), self.hits, self.stored)

    def columns(self) -> Columns:
        """A snapshot (the lists change with the next request; a view may be kept)."""
        return Columns(ids=self.ids, queues=list(self.queues), running=list(self.running), hits=self.hits,
                       stored=self.stored, waits=list(self.waits), profiles=list(self.profiles),
                       profile_values=list(self.profile_values))


class ViewList(list[WorkerView]):
    """A view list that remembers which positions were replaced (`views[i] = view`, its only
    mutation), for a caller that keeps one list and replaces the views that change: the
    planner then looks at those positions instead of comparing every view with the last
    request's (a fleet has ~1,000 views and a few change per request)."""

    _KEEP = 4  # positions remembered, per view in the list, before the oldest marks expire

    def __init__(self, views: Iterable[WorkerView] = ()) -> None:
        super().__init__(views)
        self._replaced: list[int] = []
        self._first = 0  # the mark of _replaced[0]

    def __setitem__(self, i: Any, view: Any) -> None:
        if not isinstance(i, int):
            raise TypeError("ViewList: only single positions are replaced")
        super().__setitem__(i, view)
        if len(self._replaced) >= self._KEEP * max(1, len(self)):
            self._first += len(self._replaced)
            self._replaced = []
        self._replaced.append(i % len(self))

    @property
    def mark(self) -> int:
        """Where `replaced_since` starts for replacements after now."""
        return self._first + len(self._replaced)

    def replaced_since(self, mark: int) -> list[int] | None:
        """The positions replaced since `mark` (repeats possible); None when no longer known."""
        start = mark - self._first
        return None if start < 0 else self._replaced[start:]

    def _fixed(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("ViewList: only single positions are replaced (views[i] = view)")

    __delitem__ = __iadd__ = __imul__ = append = extend = insert = pop = remove = clear = sort = reverse = _fixed


@dataclass(eq=False)
class _Group:
    """The workers of one role (and KV formats) in the caller's view list, while it holds the
    same workers: their positions, their pool when they share one, and their candidates with
    the positions whose view may have changed since the candidates last took them."""

    indices: list[int]
    at: dict[int, int]  # position in the view list -> member position
    pool: str | None  # None: members of several pools
    dirty: set[int] = field(default_factory=set)
    candidates: _PoolCandidates | None = None


class _RoleSplit:
    """The indices of each (role, KV format)'s workers in the caller's view list, kept while
    the list holds the same workers: a fleet's view list changes in a few places per request.
    Each call says which positions changed (identity); the groups collect them, so a pool's
    candidates redo only those instead of comparing every member again."""

    def __init__(self, workers: Sequence[WorkerView]) -> None:
        self.workers = list(workers)
        self.at: dict[tuple[Role, str], list[int]] = {}
        for i, w in enumerate(workers):
            self.at.setdefault((w.role, w.kv_format), []).append(i)
        self.formats: dict[Role, set[str]] = {}
        for role, fmt in self.at:
            self.formats.setdefault(role, set()).add(fmt)
        self._groups: dict[tuple[Role, frozenset[str] | None], _Group] = {}
        self._source: ViewList | None = None
        self._mark = 0
        self._watch(workers)

    def still(self, workers: Sequence[WorkerView]) -> bool:
        mine = self.workers
        if len(workers) != len(mine):
            return False
        replaced = workers.replaced_since(self._mark) if workers is self._source else None
        changed = []
        for i in compress(range(len(mine)), map(is_not, workers, mine)) if replaced is None else set(replaced):
            w, before = workers[i], mine[i]
            if w is before:
                continue
            if (w.worker_id != before.worker_id or w.role is not before.role or w.kv_format != before.kv_format
                    or w.pool != before.pool):
                return False
            mine[i] = w
            changed.append(i)
        if changed:
            for group in self._groups.values():
                group.dirty.update(changed)
        self._watch(workers)
        return True

    def _watch(self, workers: Sequence[WorkerView]) -> None:
        """From a `ViewList`, the next call reads which positions were replaced since this one."""
        self._source, self._mark = (workers, workers.mark) if isinstance(workers, ViewList) else (None, 0)

    def group(self, role: Role, formats: Iterable[str] | None = None) -> _Group:
        """The workers of `role` (with one of `formats`, if given), in list order."""
        wanted = None if formats is None else frozenset(formats)
        group = self._groups.get((role, wanted))
        if group is None:
            at = self.at
            keys = [(role, fmt) for fmt in (self.formats.get(role, ()) if wanted is None else wanted)
                    if (role, fmt) in at]
            indices = sorted(i for key in keys for i in at[key])
            pools = {self.workers[i].pool for i in indices}
            group = self._groups[role, wanted] = _Group(indices, {i: k for k, i in enumerate(indices)},
                                                        pools.pop() if len(pools) == 1 else None)
        return group

    def members(self, workers: Sequence[WorkerView], role: Role, formats: Iterable[str] | None = None) -> list[
            WorkerView]:
        """The workers of `role` (with one of `formats`, if given), in list order."""
        return list(map(workers.__getitem__, self.group(role, formats).indices))


class NoCandidate(Exception):
    """No healthy, compatible, untried worker for this leg."""


def prompt_hashes(token_ids: Sequence[int], workers: Iterable[WorkerView],
                  hasher: PrefixHasher | None = None, packed: bytes | None = None) -> dict[str, list[int]]:
    """Chained block hashes of the prompt for every KV format among `workers` (salted per
    model+format); `hasher` reuses the chains of recent prompts with the same beginning;
    `packed` is the prompt already packed (kvcache.hashing.pack_tokens), when known."""
    models = dict(zip(map(_FORMAT, workers), map(_MODEL, workers), strict=True))  # ~1,000 workers, few formats: C-level
    salts = {fmt: kv_salt(model, fmt) for fmt, model in models.items()}
    if hasher is None:
        return {fmt: block_hashes(token_ids, salt, packed=packed) for fmt, salt in salts.items()}
    return dict(zip(salts, hasher.hashes(token_ids, list(salts.values()), packed=packed), strict=True))


class RoutePlanner:
    def __init__(self, settings: RouterSettings):
        self.settings = settings
        self._policies: dict[str, Policy] = {}
        # (pool, first member, members) -> that pool's candidates, kept across requests
        self._pools: dict[tuple[str, str, int], _PoolCandidates] = {}
        self._split: _RoleSplit | None = None  # the last view list's workers by role and format

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
        self._pools.clear()
        self._split = None

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
            prefill_tokens_per_s=cost.prefill_tokens_per_s, kv_load_bytes_per_s=cost.kv_load_bytes_per_s,
            kv_bytes_per_token=cost.kv_bytes_per_token,
        )

    def _pool(self, members: Sequence[WorkerView], overlap: Overlap) -> _PoolCandidates:
        """The members' candidates with this overlap. A fleet routes over ~1,000 workers per
        request and the frozen dataclass constructor costs ~2 us: each pool's candidates are
        kept and only the members whose view or hits changed are redone."""
        key = (members[0].pool, members[0].worker_id, len(members))
        pool = self._pools.get(key)
        if pool is None or not pool.update(members, overlap):
            if len(self._pools) >= _KEEP_POOLS:  # PD bypass subsets come and go
                self._pools.clear()
            pool = self._pools[key] = _PoolCandidates(self, members)
            pool.update(members, overlap)
        return pool

    def _choose(self, role: Role, workers: list[WorkerView], prompt_tokens: int, hashes: Mapping[str, list[int]],
                overlap: Overlap, session_key: str | None) -> tuple[WorkerView, Decision, RoutingView]:
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
        return self._decide(role, pool, self._pool(members, overlap), prompt_tokens, hashes, session_key)

    def _choose_in(self, group: _Group, live: Sequence[WorkerView], role: Role, prompt_tokens: int,
                   hashes: Mapping[str, list[int]], overlap: Overlap,
                   session_key: str | None) -> tuple[WorkerView, Decision, RoutingView]:
        """`_choose` over a group of the view list: when it is one pool, its candidates redo only
        the members whose view changed since the group's last request."""
        if group.pool is None:
            return self._choose(role, [live[i] for i in group.indices], prompt_tokens, hashes, overlap, session_key)
        candidates = group.candidates
        if candidates is None or not candidates.refresh(live, group.at, group.dirty, overlap):
            members = [live[i] for i in group.indices]
            candidates = group.candidates = _PoolCandidates(self, members)
            candidates.update(members, overlap)
        group.dirty.clear()
        return self._decide(role, group.pool, candidates, prompt_tokens, hashes, session_key)

    def _decide(self, role: Role, pool: str, candidates: _PoolCandidates, prompt_tokens: int,
                hashes: Mapping[str, list[int]], session_key: str | None) -> tuple[WorkerView, Decision, RoutingView]:
        """The pool policy's choice among `candidates` (its members' views as of this request)."""
        members = candidates.members
        fmt = members[0].kv_format
        view = RoutingView(
            prompt_tokens=prompt_tokens,
            candidates=candidates.candidates(),
            block_hashes=tuple(hashes.get(fmt, ())),
            block_tokens=KV_BLOCK_TOKENS,
            session_key=session_key,
            columns=candidates.columns(),
        )
        policy = self.policy_for(pool, role)
        decision = policy.choose(view)
        policy.observe(view, decision)
        chosen = members[candidates.ids.index(decision.worker_id)]
        return chosen, decision, view

    def plan_first(self, workers: Sequence[WorkerView], prompt_tokens: int, hashes: Mapping[str, list[int]],
                   overlap: Overlap, session_key: str | None = None, exclude: frozenset[str] = frozenset()) -> Plan:
        live = [w for w in workers if w.worker_id not in exclude] if exclude else workers
        split = self._role_split(live)
        decode_formats = split.formats.get(Role.DECODE)
        if decode_formats and Role.PREFILL in split.formats:
            bypass = self._bypass_candidates(split, live, prompt_tokens, overlap)
            if bypass:
                chosen, decision, view = self._choose(Role.DECODE, bypass, prompt_tokens, hashes, overlap, session_key)
                decision = Decision(decision.worker_id, Reason.BYPASS, decision.costs,
                                    *self._predicted(chosen, prompt_tokens, overlap))
                return Plan(Mode.BYPASS, chosen, decision, view)
            prefill = split.group(Role.PREFILL, decode_formats)  # those a decode worker can continue
            if prefill.indices:
                chosen, decision, view = self._choose_in(prefill, live, Role.PREFILL, prompt_tokens, hashes, overlap,
                                                         session_key)
                return Plan(Mode.PD, chosen, self._with_prediction(decision, chosen, prompt_tokens, overlap), view)
        unified = split.group(Role.UNIFIED)
        if unified.indices:
            chosen, decision, view = self._choose_in(unified, live, Role.UNIFIED, prompt_tokens, hashes, overlap,
                                                     session_key)
            return Plan(Mode.UNIFIED, chosen, self._with_prediction(decision, chosen, prompt_tokens, overlap), view)
        raise NoCandidate("no healthy worker can serve this request")

    def plan_decode(self, workers: Sequence[WorkerView], kv_format: str, prompt_tokens: int,
                    exclude: frozenset[str] = frozenset()) -> tuple[WorkerView, Decision]:
        live = [w for w in workers if w.worker_id not in exclude] if exclude else workers
        decode = self._role_split(live).group(Role.DECODE, (kv_format,))
        if not decode.indices:
            raise NoCandidate(f"no healthy decode worker with KV format {kv_format}")
        chosen, decision, _ = self._choose_in(decode, live, Role.DECODE, prompt_tokens, {}, Overlap(), None)
        return chosen, decision

    def _role_split(self, workers: Sequence[WorkerView]) -> _RoleSplit:
        split = self._split
        if split is None or not split.still(workers):
            split = self._split = _RoleSplit(workers)
        return split

    def _bypass_candidates(self, split: _RoleSplit, live: Sequence[WorkerView], prompt_tokens: int,
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

    def _with_prediction(self, decision: Decision, w: WorkerView, prompt_tokens: int, overlap: Overlap) -> Decision:
        """Every policy's decision carries the index's prediction for the chosen worker (honesty metrics)."""
        mem, store = self._predicted(w, prompt_tokens, overlap)
        return Decision(decision.worker_id, decision.reason, decision.costs, mem, store)
