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

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from deepinfer_gateway.config import HardwareCost, RouterSettings
from deepinfer_gateway.kvcache.hashing import PrefixHasher, block_hashes, kv_salt
from deepinfer_gateway.kvcache.types import Overlap
from deepinfer_gateway.protocol import KV_BLOCK_TOKENS, Role
from deepinfer_gateway.router.policies import make_policy
from deepinfer_gateway.router.policy import Candidate, Decision, Policy, Reason, RoutingView
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


@dataclass(frozen=True)
class Plan:
    mode: str  # unified | pd | bypass
    worker: WorkerView  # first leg: the unified, prefill or (bypass) decode worker
    decision: Decision
    view: RoutingView


# `Candidate(**fields)` without the frozen dataclass's per-field object.__setattr__: the same
# object as long as Candidate keeps a plain __dict__ and has no __post_init__.
assert not hasattr(Candidate, "__slots__") and not hasattr(Candidate, "__post_init__")
_new_object = object.__new__


def _with_hits(base: Candidate, memory_hit_blocks: int, store_hit_blocks: int) -> Candidate:
    c = _new_object(Candidate)
    fields = c.__dict__
    fields.update(base.__dict__)
    fields["memory_hit_blocks"] = memory_hit_blocks
    fields["store_hit_blocks"] = store_hit_blocks
    return c


class NoCandidate(Exception):
    """No healthy, compatible, untried worker for this leg."""


def prompt_hashes(token_ids: Sequence[int], workers: Iterable[WorkerView],
                  hasher: PrefixHasher | None = None, packed: bytes | None = None) -> dict[str, list[int]]:
    """Chained block hashes of the prompt for every KV format among `workers` (salted per
    model+format); `hasher` reuses the chains of recent prompts with the same beginning;
    `packed` is the prompt already packed (kvcache.hashing.pack_tokens), when known."""
    models = {w.kv_format: w.model for w in workers}  # a fleet has ~1,000 workers and few formats
    salts = {fmt: kv_salt(model, fmt) for fmt, model in models.items()}
    if hasher is None:
        return {fmt: block_hashes(token_ids, salt, packed=packed) for fmt, salt in salts.items()}
    return dict(zip(salts, hasher.hashes(token_ids, list(salts.values()), packed=packed), strict=True))


class RoutePlanner:
    def __init__(self, settings: RouterSettings):
        self.settings = settings
        self._policies: dict[str, Policy] = {}
        # worker id -> [view, its no-hit candidate, memory hits, store hits, the candidate with those]
        self._bases: dict[str, list[Any]] = {}
        # (pool, first member) -> the last call without hits: (members, candidates)
        self._no_hits: dict[tuple[str, str], tuple[list[WorkerView], tuple[Candidate, ...]]] = {}

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
        self._bases.clear()
        self._no_hits.clear()

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

    def _candidates(self, members: list[WorkerView], overlap: Overlap) -> tuple[Candidate, ...]:
        """One `Candidate` per member with its overlap. A fleet routes over ~1,000 workers per
        request and the frozen dataclass constructor costs ~2 us, so each worker's last
        candidate is kept and reused while its view and hits are unchanged (most of them
        from one request to the next); a new hit on the same view copies the fields.
        Without any hit (a decode leg), the last such list of the same members is reused
        with only the members whose view changed redone."""
        if overlap.memory or overlap.store:
            return self._with_overlap(members, overlap)
        key = (members[0].pool, members[0].worker_id)
        last = self._no_hits.get(key)
        if last is not None and len(last[0]) == len(members):
            changed = [i for i, (w, before) in enumerate(zip(members, last[0], strict=True)) if w is not before]
            if not changed:
                return last[1]
            redone = self._with_overlap([members[i] for i in changed], overlap)
            out = list(last[1])
            for i, candidate in zip(changed, redone, strict=True):
                out[i] = candidate
            candidates = tuple(out)
        else:
            candidates = self._with_overlap(members, overlap)
        self._no_hits[key] = (list(members), candidates)
        return candidates

    def _with_overlap(self, members: list[WorkerView], overlap: Overlap) -> tuple[Candidate, ...]:
        cache = self._bases
        memory = overlap.memory.get
        store = overlap.store.get
        out = []
        for w in members:
            mem, stored = memory(w.worker_id, 0), store(w.kv_format, 0)
            entry = cache.get(w.worker_id)
            if entry is None or (entry[0] is not w and entry[0] != w):
                base = self._base(w)
                entry = cache[w.worker_id] = [w, base, 0, 0, base]
            elif entry[2] == mem and entry[3] == stored:
                out.append(entry[4])
                continue
            base = entry[1]
            candidate = _with_hits(base, mem, stored) if mem or stored else base
            entry[2:] = mem, stored, candidate
            out.append(candidate)
        return tuple(out)

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
        fmt = members[0].kv_format
        view = RoutingView(
            prompt_tokens=prompt_tokens,
            candidates=self._candidates(members, overlap),
            block_hashes=tuple(hashes.get(fmt, ())),
            block_tokens=KV_BLOCK_TOKENS,
            session_key=session_key,
        )
        policy = self.policy_for(pool, role)
        decision = policy.choose(view)
        policy.observe(view, decision)
        chosen = next(w for w in members if w.worker_id == decision.worker_id)
        return chosen, decision, view

    def plan_first(self, workers: Sequence[WorkerView], prompt_tokens: int, hashes: Mapping[str, list[int]],
                   overlap: Overlap, session_key: str | None = None, exclude: frozenset[str] = frozenset()) -> Plan:
        live = [w for w in workers if w.worker_id not in exclude] if exclude else workers
        prefill = [w for w in live if w.role is Role.PREFILL]
        decode = [w for w in live if w.role is Role.DECODE]
        unified = [w for w in live if w.role is Role.UNIFIED]
        if prefill and decode:
            bypass = self._bypass_candidates(decode, prompt_tokens, overlap)
            if bypass:
                chosen, decision, view = self._choose(Role.DECODE, bypass, prompt_tokens, hashes, overlap, session_key)
                decision = Decision(decision.worker_id, Reason.BYPASS, decision.costs,
                                    *self._predicted(chosen, prompt_tokens, overlap))
                return Plan("bypass", chosen, decision, view)
            compatible = {w.kv_format for w in decode}
            prefill = [w for w in prefill if w.kv_format in compatible]
            if prefill:
                chosen, decision, view = self._choose(Role.PREFILL, prefill, prompt_tokens, hashes, overlap,
                                                      session_key)
                return Plan("pd", chosen, self._with_prediction(decision, chosen, prompt_tokens, overlap), view)
        if unified:
            chosen, decision, view = self._choose(Role.UNIFIED, unified, prompt_tokens, hashes, overlap, session_key)
            return Plan("unified", chosen, self._with_prediction(decision, chosen, prompt_tokens, overlap), view)
        raise NoCandidate("no healthy worker can serve this request")

    def plan_decode(self, workers: Sequence[WorkerView], kv_format: str, prompt_tokens: int,
                    exclude: frozenset[str] = frozenset()) -> tuple[WorkerView, Decision]:
        decode = [w for w in workers if w.role is Role.DECODE and w.kv_format == kv_format
                  and w.worker_id not in exclude]
        if not decode:
            raise NoCandidate(f"no healthy decode worker with KV format {kv_format}")
        chosen, decision, _ = self._choose(Role.DECODE, decode, prompt_tokens, {}, Overlap(), None)
        return chosen, decision

    def _bypass_candidates(self, decode: list[WorkerView], prompt_tokens: int, overlap: Overlap) -> list[WorkerView]:
        limit = self.settings.pd_bypass_tokens
        if limit <= 0:
            return []
        # Nobody qualifies unless the longest hit anywhere does (one pass in C, not one per worker).
        best = max(max(overlap.memory.values(), default=0), max(overlap.store.values(), default=0))
        if prompt_tokens - min(best * KV_BLOCK_TOKENS, prompt_tokens) > limit:
            return []
        out = []
        for w in (w for w in decode if w.prefills):
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
