"""The simulated engine's continuous-batching scheduler: a pure discrete-event object.

No clock, no sleeping, no I/O: the caller passes `now` (unix seconds, used only for
store TTLs) and gets back how long the step took and what each request produced. The
real-time engine (engine.py) sleeps that long; an offline simulator can advance a
virtual clock instead.

Per step and per DP rank (ranks step in lockstep; the instance's step lasts as long as
its slowest rank), like DeepInfer/vLLM with chunked prefill:
1. admit waiting requests while the rank has fewer than `max_num_seqs` running and the
   instance has KV blocks for the whole request (prompt + planned output: the sim knows
   its output length, so it never runs out mid-request). Admission looks the prompt up
   in the memory prefix cache, then in the shared store: memory hits are free, store
   hits cost their KV bytes at the profile's store read bandwidth. The order is the
   profile's `scheduling_policy`: "fcfs" by arrival; "priority" (SGLang's priority
   scheduling with preemption; vLLM's orders the same way but preempts only on KV
   shortage) by (`priority`, arrival), and a waiting request that finds no slot or no KV
   preempts the running request of the highest priority value above its own, latest
   arrival first: its KV is freed and it waits again at its place, then
   recomputes its prompt and the tokens it had emitted (the prefix cache may hold part)
   and goes on from there. A decode-role request (KV handed over) is never preempted;
2. every running request past prefill decodes: 1 token, plus with speculative decoding
   (`nextn` > 0) each of `nextn` draft tokens accepted with probability `acceptance`,
   drawn per step from the request's own RNG (seeded by its request id, so a run is
   reproducible and a request's draws do not depend on what else runs; cruise.py relies
   on that);
3. the rest of the `max_num_batched_tokens` budget prefills waiting prompt tokens in
   chunks, oldest first (under priority scheduling, most urgent first); a request whose
   prefill completes emits its first token.
The blocks a step's prefill chunks complete enter the memory cache once every rank's part of
the step is done (a request admitted beside them on another rank cannot hit them; one admitted
at a later step can, before the prompt's last chunk, as with vLLM's and SGLang's chunked
prefill); a completed prompt's blocks enter the store too; at finish the full sequence's
blocks do (multi-turn prompts re-send the previous answer). The KV events these append are
the worker's to publish when the step's time has passed (kv_events.py).

Simplifications (documented, deliberate): one prefix cache per instance, not per DP
rank; cached blocks and running requests' blocks are accounted separately; store
bandwidth is not shared between readers; TTL expiry emits no events (the index has
`expires_at`). Every returned duration is divided by `time_scale`.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TypeGuard

from deepinfer_gateway.core.protocol import (
    KV_BLOCK_TOKENS,
    DpRankLoad,
    ErrorKind,
    FinishReason,
    KvEventKind,
    KvTier,
    WorkloadClass,
)
from deepinfer_gateway.kvcache.hashing import BlockHashes, block_hashes, extend_block_hashes, kv_salt
from deepinfer_gateway.workers.sim.kv_events import SimKvEventLog
from deepinfer_gateway.workers.sim.kv_store import SimKvStore
from deepinfer_gateway.workers.sim.prefix_cache import PrefixCache
from deepinfer_gateway.workers.sim.profiles import HardwareProfile
from deepinfer_gateway.workers.sim.step_model import decode_seconds, kv_load_seconds, prefill_seconds


class AdmissionError(Exception):
    def __init__(self, kind: ErrorKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass
class SimRequest:
    request_id: str
    token_ids: Sequence[int]  # the prompt (decode role: prompt + first token)
    output: list[int]  # every token this worker will emit, in order
    finish_reason: FinishReason  # once `output` is exhausted
    workload_class: WorkloadClass = "chat"
    stop_after_first: bool = False  # prefill role
    kv_loaded_seconds: float | None = None  # decode role: KV arrives by transfer at this cost
    cache_salt: str | None = None  # its blocks are shared only with requests of the same salt
    priority: int = 0  # a lower value runs first (the profile's scheduling_policy "priority")


@dataclass
class RequestUpdate:
    """What one request produced during a step."""

    request_id: str
    ready: tuple[int, int] | None = None  # (cached memory tokens, cached store tokens)
    token_ids: list[int] = field(default_factory=list)
    finish: FinishReason | None = None
    handoff: bool = False  # finished after the first token; the rest continues on a decode worker
    num_output_tokens: int = 0


@dataclass
class _Seq:
    req: SimRequest
    rank: int
    hashes: list[int]
    blocks: int  # KV blocks reserved while running
    computed: int = 0  # prompt tokens with KV
    emitted: int = 0
    prefilled: bool = False
    rng: random.Random | None = None  # speculative decoding's acceptance draws (None: no draws)
    order: int = 0  # arrival order on this worker
    recompute: int = 0  # emitted tokens to recompute after a preemption, besides the prompt
    preemptions: int = 0

    @property
    def remaining_prefill(self) -> int:
        return len(self.req.token_ids) + self.recompute - self.computed

    @property
    def rank_key(self) -> tuple[int, int]:
        """Priority scheduling's order: the least key runs first and is preempted last."""
        return self.req.priority, self.order


def _blocks(tokens: int) -> int:
    return -(-tokens // KV_BLOCK_TOKENS)


class SchedulerCore:
    def __init__(
        self,
        profile: HardwareProfile,
        events: SimKvEventLog,
        model: str,
        store: SimKvStore | None = None,
        time_scale: float = 1.0,
    ) -> None:
        if time_scale <= 0:
            raise ValueError("time_scale must be > 0")
        self.profile = profile
        self.events = events
        self.cache = PrefixCache(profile.memory_capacity_blocks, events)
        self.store = store
        self.time_scale = time_scale
        self.model = model
        self.salt = kv_salt(model, profile.kv_format)
        self._waiting: list[deque[_Seq]] = [deque() for _ in range(profile.dp_ranks)]
        self._running: list[list[_Seq]] = [[] for _ in range(profile.dp_ranks)]
        self._seqs: dict[str, _Seq] = {}
        self._used_blocks = 0
        self._arrivals = 0
        self.by_priority = profile.scheduling_policy == "priority"
        self.preemptions_total = 0
        self.prompt_tokens_total = 0
        self.cached_tokens_total = {KvTier.MEMORY: 0, KvTier.STORE: 0}
        self.evicted_recomputed_tokens_total = 0  # prefilled again after this worker evicted them (prefix_cache.py)

    # --- requests ---------------------------------------------------------------------

    def hashes(self, token_ids: Sequence[int], known: list[int] | None = None,
               cache_salt: str | None = None) -> list[int]:
        """Block hashes of `token_ids` under this worker's salt (and the request's `cache_salt`:
        then no block is shared with a request of another salt). `known`: the hashes of a
        prefix of `token_ids`; when they carry their chain (`BlockHashes`) under this
        salt, only the blocks past them are digested."""
        salt = self._salt_of(cache_salt)
        if self._chains_on(known, salt):
            return extend_block_hashes(known, token_ids[len(known) * KV_BLOCK_TOKENS :])
        return block_hashes(token_ids, salt)

    def _salt_of(self, cache_salt: str | None) -> bytes:
        return self.salt if cache_salt is None else kv_salt(self.model, self.profile.kv_format, cache_salt)

    @staticmethod
    def _chains_on(known: list[int] | None, salt: bytes) -> TypeGuard[BlockHashes]:
        return isinstance(known, BlockHashes) and known.salt == salt

    def add_request(self, req: SimRequest, hashes: list[int] | None = None) -> None:
        """Queue a request; raises AdmissionError when it can never run here."""
        if req.request_id in self._seqs:
            raise AdmissionError(ErrorKind.INVALID_REQUEST, f"request {req.request_id!r} is already in flight")
        total = len(req.token_ids) + len(req.output)
        if len(req.token_ids) >= self.profile.max_model_len:
            raise AdmissionError(ErrorKind.PROMPT_TOO_LONG,
                                 f"prompt of {len(req.token_ids)} tokens exceeds max_model_len")
        blocks = _blocks(total)
        if blocks > self.profile.memory_capacity_blocks:
            raise AdmissionError(ErrorKind.RESOURCE_EXHAUSTED, f"request needs {blocks} KV blocks, worker has fewer")
        rank = min(range(self.profile.dp_ranks), key=self._rank_pressure)
        seq = _Seq(req, rank, hashes if hashes is not None else self.hashes(req.token_ids, cache_salt=req.cache_salt),
                   blocks)
        if self.profile.nextn and 0.0 < self.profile.acceptance < 1.0:
            seq.rng = random.Random(req.request_id)  # str seeds are hashed with SHA-512: stable across runs
        self._arrivals += 1
        seq.order = self._arrivals
        self._seqs[req.request_id] = seq
        self._enqueue(seq)

    def _enqueue(self, seq: _Seq) -> None:
        """Into its rank's waiting line: at the end, or under priority scheduling before the first
        request it outranks."""
        waiting = self._waiting[seq.rank]
        if self.by_priority and waiting and waiting[-1].rank_key > seq.rank_key:
            key = seq.rank_key
            waiting.insert(next(i for i, w in enumerate(waiting) if w.rank_key > key), seq)
        else:
            waiting.append(seq)

    def abort(self, request_id: str) -> bool:
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return False
        if seq in self._waiting[seq.rank]:
            self._waiting[seq.rank].remove(seq)
        else:
            self._running[seq.rank].remove(seq)
            self._used_blocks -= seq.blocks
        return True

    def has_work(self) -> bool:
        return bool(self._seqs)

    # --- one iteration ----------------------------------------------------------------

    def step(self, now: float) -> tuple[float, list[RequestUpdate]]:
        updates: dict[str, RequestUpdate] = {}
        prefilled: list[_Seq] = []
        slowest = 0.0
        for rank in range(self.profile.dp_ranks):
            slowest = max(slowest, self._step_rank(rank, now, updates, prefilled))
        # What this step prefilled is cached once every rank has admitted: a request admitted
        # beside a prefill, on another rank, cannot hit what that step computes.
        for seq in prefilled:
            if seq.prefilled:
                self._cache_blocks(seq.hashes, seq.req.workload_class, now)
            else:
                self.cache.insert(seq.hashes[: seq.computed // KV_BLOCK_TOKENS])
        return slowest / self.time_scale, list(updates.values())

    def _step_rank(self, rank: int, now: float, updates: dict[str, RequestUpdate], prefilled: list[_Seq]) -> float:
        load_s = self._admit(rank, now, updates)
        running = self._running[rank]
        decoding = [s for s in running if s.prefilled]
        budget = self.profile.max_num_batched_tokens - len(decoding)
        chunk = 0
        done: list[_Seq] = []
        # Priority scheduling prefills the most urgent first (SGLang builds its prefill batch from
        # the priority-ordered queue); otherwise the oldest first.
        for seq in sorted(running, key=lambda r: r.rank_key) if self.by_priority else running:
            if budget <= 0:
                break
            if seq.prefilled or seq.remaining_prefill == 0:
                continue
            take = min(seq.remaining_prefill, budget)
            seq.computed += take
            chunk += take
            budget -= take
            prefilled.append(seq)
            if seq.remaining_prefill == 0:
                done.append(seq)
        for seq in decoding:
            self._emit(seq, self.step_tokens(seq), now, updates)
        for seq in done:
            seq.prefilled = True
            self._emit(seq, 1, now, updates)
        return load_s + prefill_seconds(self.profile, chunk) + decode_seconds(self.profile, len(decoding))

    def step_tokens(self, seq: _Seq) -> int:
        """How many tokens `seq` emits in this decode step: 1 + its accepted draft tokens."""
        nextn = self.profile.nextn
        rng = seq.rng
        if rng is None:  # no drafts, or every draft accepted (acceptance 1) or none (0)
            return 1 + nextn if self.profile.acceptance >= 1.0 else 1
        draw, p = rng.random, self.profile.acceptance
        return 1 + sum(draw() < p for _ in range(nextn))

    def _admit(self, rank: int, now: float, updates: dict[str, RequestUpdate]) -> float:
        """Move waiting requests into the batch; returns the KV load time they cost."""
        waiting, running = self._waiting[rank], self._running[rank]
        load_s = 0.0
        while waiting:
            seq = waiting[0]
            if (len(running) >= self.profile.max_num_seqs
                    or self._used_blocks + seq.blocks > self.profile.memory_capacity_blocks):
                if self.by_priority and self._preempt_for(seq):
                    continue
                break  # wait for running requests to finish
            waiting.popleft()
            running.append(seq)
            self._used_blocks += seq.blocks
            prompt = len(seq.req.token_ids)
            if seq.preemptions:  # resumed: recompute what the cache no longer holds, announced once
                usable = seq.hashes[: (prompt - 1) // KV_BLOCK_TOKENS]
                seq.computed = self.cache.match(usable) * KV_BLOCK_TOKENS
                continue
            if seq.req.kv_loaded_seconds is not None:  # decode role: KV handed over
                seq.computed = prompt
                seq.prefilled = True
                self.cache.insert(seq.hashes)
                load_s += seq.req.kv_loaded_seconds
                updates[seq.req.request_id] = RequestUpdate(seq.req.request_id, ready=(0, 0))
                continue
            # At least one prompt token is always computed (it yields the first token).
            usable = seq.hashes[: (prompt - 1) // KV_BLOCK_TOKENS]
            in_memory = self.cache.match(usable)
            in_store = self.store.match(usable, now) if self.store is not None else 0
            mem_tokens = in_memory * KV_BLOCK_TOKENS
            store_tokens = max(0, in_store - in_memory) * KV_BLOCK_TOKENS
            seq.computed = mem_tokens + store_tokens
            self.evicted_recomputed_tokens_total += KV_BLOCK_TOKENS * self.cache.evicted_among(
                usable[max(in_memory, in_store):])
            load_s += kv_load_seconds(self.profile, store_tokens, self.profile.store_read_bytes_per_s)
            self.prompt_tokens_total += prompt
            self.cached_tokens_total[KvTier.MEMORY] += mem_tokens
            self.cached_tokens_total[KvTier.STORE] += store_tokens
            updates[seq.req.request_id] = RequestUpdate(seq.req.request_id, ready=(mem_tokens, store_tokens))
        return load_s

    def _preempt_for(self, seq: _Seq) -> bool:
        """Preempt the running request of `seq`'s rank that `seq` outranks by priority value, the
        least urgent and latest first; False when there is none (decode-role requests stay)."""
        victims = [r for r in self._running[seq.rank]
                   if r.req.priority > seq.req.priority and r.req.kv_loaded_seconds is None]
        if not victims:
            return False
        victim = max(victims, key=lambda r: r.rank_key)
        self._running[seq.rank].remove(victim)
        self._used_blocks -= victim.blocks
        victim.computed, victim.prefilled = 0, False
        victim.recompute = victim.emitted
        victim.preemptions += 1
        self.preemptions_total += 1
        self._enqueue(victim)
        return True

    def _emit(self, seq: _Seq, n: int, now: float, updates: dict[str, RequestUpdate]) -> None:
        req = seq.req
        new = req.output[seq.emitted : seq.emitted + n]
        seq.emitted += len(new)
        update = updates.setdefault(req.request_id, RequestUpdate(req.request_id))
        update.token_ids.extend(new)
        done = seq.emitted >= len(req.output)
        if req.stop_after_first and not done:
            update.handoff = True
        elif not done:
            return
        update.finish = req.finish_reason if done else FinishReason.STOP
        update.num_output_tokens = seq.emitted
        self._finish(seq, now)

    def _finish(self, seq: _Seq, now: float) -> None:
        del self._seqs[seq.req.request_id]
        self._running[seq.rank].remove(seq)
        self._used_blocks -= seq.blocks
        prompt, known = seq.req.token_ids, seq.hashes
        if (len(prompt) + seq.emitted) // KV_BLOCK_TOKENS > len(known):
            # The prompt's blocks are known: digest only the ones past them.
            start = len(known) * KV_BLOCK_TOKENS
            full: list[int]
            if self._chains_on(known, self._salt_of(seq.req.cache_salt)) and start <= len(prompt):  # no prompt copy
                full = extend_block_hashes(known, [*prompt[start:], *seq.req.output[: seq.emitted]])
            else:
                full = self.hashes([*prompt, *seq.req.output[: seq.emitted]], cache_salt=seq.req.cache_salt)
            self._cache_blocks(full, seq.req.workload_class, now)

    def _cache_blocks(self, hashes: list[int], workload_class: WorkloadClass, now: float) -> None:
        self.cache.insert(hashes)
        if self.store is not None and hashes:
            put = self.store.put(hashes, workload_class, now)
            self.events.append(KvEventKind.STORED, KvTier.STORE, put.stored, put.expires_at)
            self.events.append(KvEventKind.EVICTED, KvTier.STORE, put.evicted)

    # --- load -------------------------------------------------------------------------

    def _rank_pressure(self, rank: int) -> tuple[int, int]:
        return len(self._running[rank]) + len(self._waiting[rank]), self._queued_tokens(rank)

    def _queued_tokens(self, rank: int) -> int:
        return sum(s.remaining_prefill for s in self._waiting[rank]) + sum(
            s.remaining_prefill for s in self._running[rank] if not s.prefilled
        )

    def load_totals(self) -> tuple[int, int]:
        """(queued prefill tokens, running) summed over the DP ranks, as `rank_loads` reports
        them, without building the reports (the simulator reads these every tick)."""
        ranks = range(self.profile.dp_ranks)
        return sum(map(self._queued_tokens, ranks)), sum(map(len, self._running))

    def rank_loads(self) -> list[DpRankLoad]:
        return [
            DpRankLoad(
                dp_rank=r,
                running=len(self._running[r]),
                waiting=len(self._waiting[r]),
                queued_prefill_tokens=self._queued_tokens(r),
            )
            for r in range(self.profile.dp_ranks)
        ]

    @property
    def kv_usage(self) -> float:
        return min(1.0, self._used_blocks / self.profile.memory_capacity_blocks)
