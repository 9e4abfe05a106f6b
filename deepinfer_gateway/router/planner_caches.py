"""The planner's caches kept between requests (router/planner.py decides; this keeps).

A fleet routes over ~1,000 workers per request while only a few views change from one
request to the next (a load report, a reservation): these caches keep each pool's
candidates as columns updated in place (`PoolCandidates`) and the view list's workers by
role and KV format (`RoleSplit`), so a request redoes the changed views only. They pay off
in the offline simulator at 1,024 workers, which keeps one view list and replaces the views
that change (simulate/views.py `ViewList`, a `ReplacementLog`); the live gateway builds fresh
views per request, so they never engage there. Every path gives the planner the same
candidates, columns and order as building them afresh (tests/unit/test_planner_reuse.py,
test_planner_groups.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import compress, repeat
from operator import is_not
from typing import Any, Protocol, runtime_checkable

from deepinfer_gateway.core.protocol import Role
from deepinfer_gateway.kvcache.types import Overlap
from deepinfer_gateway.router.policy import CROWD, PROFILE, Candidate, Columns
from deepinfer_gateway.router.worker_view import WorkerView


@runtime_checkable
class ReplacementLog(Protocol):
    """A view list that says which positions were replaced since a mark (simulate/views.py)."""

    @property
    def mark(self) -> int: ...

    def replaced_since(self, mark: int) -> list[int] | None: ...


# `Candidate(**fields)` without the frozen dataclass's per-field object.__setattr__: the same
# object as long as Candidate keeps a plain __dict__ and has no __post_init__.
assert not hasattr(Candidate, "__slots__") and not hasattr(Candidate, "__post_init__")
_new_object = object.__new__
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


class PoolCandidates:
    """One pool's candidates across requests, as columns (router/policy.py `Columns`) updated
    in place: from one request to the next only a few views change (a load report, a
    reservation), so a request costs a few C-level passes over the pool (which views
    differ, the hits per member) plus Python work for the changed views only."""

    def __init__(self, base_of: Callable[[WorkerView], Candidate], members: Sequence[WorkerView]) -> None:
        n = len(members)
        self.base_of = base_of
        self.members = list(members)
        self.bases = [base_of(w) for w in members]  # each member's candidate with no hit
        self.ids = [w.worker_id for w in members]
        self.formats = [w.kv_format for w in members]
        self.hits = [0] * n  # replaced, never changed in place: snapshots share them
        self.stored = [0] * n  # same
        self.store: Mapping[str, int] = {}
        self.queues = [c.queued_prefill_tokens for c in self.bases]
        self.running = [c.running for c in self.bases]
        self.waits = [c.queued_prefill_tokens / c.prefill_tokens_per_s for c in self.bases]
        self.crowds = list(map(CROWD, self.bases))
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
            base = self.bases[i] = self.base_of(w)
            self.formats[i] = w.kv_format
            self.queues[i] = base.queued_prefill_tokens
            self.running[i] = base.running
            self.waits[i] = base.queued_prefill_tokens / base.prefill_tokens_per_s
            self.crowds[i] = CROWD(base)
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
                       stored=self.stored, waits=list(self.waits), crowds=list(self.crowds),
                       profiles=list(self.profiles),
                       profile_values=list(self.profile_values))


@dataclass(eq=False)
class Group:
    """The workers of one role (and KV formats) in the caller's view list, while it holds the
    same workers: their positions, their pool when they share one, and their candidates with
    the positions whose view may have changed since the candidates last took them."""

    indices: list[int]
    at: dict[int, int]  # position in the view list -> member position
    pool: str | None  # None: members of several pools
    dirty: set[int] = field(default_factory=set)
    candidates: PoolCandidates | None = None


class RoleSplit:
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
        self._groups: dict[tuple[Role, frozenset[str] | None], Group] = {}
        self._source: ReplacementLog | None = None
        self._mark = 0
        self._watch(workers)

    def still(self, workers: Sequence[WorkerView]) -> bool:
        mine = self.workers
        if len(workers) != len(mine):
            return False
        source = self._source
        # the same list object as last time (identity: a ReplacementLog is also a Sequence[WorkerView])
        replaced = source.replaced_since(self._mark) if source is not None and id(source) == id(workers) else None
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
        """From a `ReplacementLog`, the next call reads which positions were replaced since this one."""
        self._source, self._mark = (workers, workers.mark) if isinstance(workers, ReplacementLog) else (None, 0)

    def group(self, role: Role, formats: Iterable[str] | None = None) -> Group:
        """The workers of `role` (with one of `formats`, if given), in list order."""
        wanted = None if formats is None else frozenset(formats)
        group = self._groups.get((role, wanted))
        if group is None:
            at = self.at
            keys = [(role, fmt) for fmt in (self.formats.get(role, ()) if wanted is None else wanted)
                    if (role, fmt) in at]
            indices = sorted(i for key in keys for i in at[key])
            pools = {self.workers[i].pool for i in indices}
            group = self._groups[role, wanted] = Group(indices, {i: k for k, i in enumerate(indices)},
                                                        pools.pop() if len(pools) == 1 else None)
        return group

    def members(self, workers: Sequence[WorkerView], role: Role, formats: Iterable[str] | None = None) -> list[
            WorkerView]:
        """The workers of `role` (with one of `formats`, if given), in list order."""
        return list(map(workers.__getitem__, self.group(role, formats).indices))


class PlannerCaches:
    """Every cache of one planner: each pool's candidates (by pool, first member and size) and
    the last view list's split by role and format. `base_of`: a worker's candidate, no hit."""

    def __init__(self, base_of: Callable[[WorkerView], Candidate]) -> None:
        self._base_of = base_of
        self._pools: dict[tuple[str, str, int], PoolCandidates] = {}
        self._split: RoleSplit | None = None

    def clear(self) -> None:
        self._pools.clear()
        self._split = None

    def role_split(self, workers: Sequence[WorkerView]) -> RoleSplit:
        split = self._split
        if split is None or not split.still(workers):
            split = self._split = RoleSplit(workers)
        return split

    def pool(self, members: Sequence[WorkerView], overlap: Overlap) -> PoolCandidates:
        """The members' candidates with this overlap. The frozen dataclass constructor costs ~2 us:
        each pool's candidates are kept and only the members whose view or hits changed are redone."""
        key = (members[0].pool, members[0].worker_id, len(members))
        pool = self._pools.get(key)
        if pool is None or not pool.update(members, overlap):
            if len(self._pools) >= _KEEP_POOLS:  # PD bypass subsets come and go
                self._pools.clear()
            pool = self._pools[key] = PoolCandidates(self._base_of, members)
            pool.update(members, overlap)
        return pool

    def group_pool(self, group: Group, live: Sequence[WorkerView], overlap: Overlap) -> PoolCandidates:
        """The candidates of a one-pool group of the view list: only the members whose view
        changed since the group's last request are redone."""
        candidates = group.candidates
        if candidates is None or not candidates.refresh(live, group.at, group.dirty, overlap):
            members = [live[i] for i in group.indices]
            candidates = group.candidates = PoolCandidates(self._base_of, members)
            candidates.update(members, overlap)
        group.dirty.clear()
        return candidates
