"""What the planner sees for one request, and the admission check on its choice.

Candidates are the healthy workers with an info report, as `WorkerView`s: the last load
report plus what this gateway knows since (its own open calls, in-flight bookings shared
through Redis across replicas: router/inflight.py). The prompt's block hashes (one chain per KV format)
are looked up in the prefix index in one call. The admission rule is router/admission.py's
`retry_after`, which the simulator applies too.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence

from deepinfer_gateway.config import GatewaySettings
from deepinfer_gateway.core import tracing
from deepinfer_gateway.core.errors import NoHealthyWorker, Overloaded
from deepinfer_gateway.core.session_identity import SessionIdentity
from deepinfer_gateway.gateway.fleet.registry import WorkerRegistry, WorkerState
from deepinfer_gateway.gateway.serving.shared_affinity import SharedAffinity
from deepinfer_gateway.gateway.telemetry.metrics import GatewayMetrics
from deepinfer_gateway.kvcache.hashing import PrefixHasher
from deepinfer_gateway.kvcache.routed import RoutedPrefixes
from deepinfer_gateway.kvcache.types import Overlap, PrefixIndex
from deepinfer_gateway.recipe_bridge.prepare import PreparedRequest
from deepinfer_gateway.router.admission import retry_after
from deepinfer_gateway.router.booking import crowd_fields, scheduled_since
from deepinfer_gateway.router.inflight import MemoryInflight, RedisInflight
from deepinfer_gateway.router.planner import Plan, RoutePlanner, WorkerView, prompt_hashes
from deepinfer_gateway.router.policy import Lineage
from deepinfer_gateway.router.session_continuity import SessionPrefixes

log = logging.getLogger(__name__)

# The worker role of a plan's first leg.
LEG_ROLE = {"unified": "unified", "pd": "prefill", "bypass": "unified"}


def worker_view(worker: WorkerState, booked: int, now: float = 0.0, own: int = 0) -> WorkerView | None:
    """A worker as the planner sees it (`now`: loop time; `own`: of `booked`, this process's
    bookings); None before its first info report."""
    if worker.info is None:
        return None
    load = worker.load
    dp_ranks = len(load.dp_ranks) if load and load.dp_ranks else worker.info.dp_size
    return WorkerView(
        worker_id=worker.worker_id, role=worker.spec.role, pool=worker.pool, hardware=str(worker.spec.hardware),
        kv_format=worker.kv_format, model=worker.info.model,
        queued_prefill_tokens=max(0, (load.queued_prefill_tokens if load else 0) + booked),
        booked_tokens=booked, own_booked=own, load_age_s=round(now - worker.load_probed_at, 4) if load else 0.0,
        running=(load.running if load else 0) + worker.inflight,
        **crowd_fields(worker),
        waiting=load.waiting if load else 0, kv_usage=load.kv_usage if load else 0.0,
        dp_ranks=dp_ranks, slots=(worker.spec.max_num_seqs or worker.info.max_num_seqs or 0) * dp_ranks,
        prefills=worker.info.prefills, preempts=worker.info.priority_preemption,
    )


class RouteInputs:
    """Candidates, prefix overlap, admission and the routing record for the request path."""

    def __init__(self, registry: WorkerRegistry, planner: RoutePlanner, index: PrefixIndex,
                 inflight: MemoryInflight | RedisInflight, metrics: GatewayMetrics, settings: GatewaySettings,
                 affinity: SharedAffinity | None = None):
        self.registry = registry
        self.affinity = affinity  # the replicas' shared session -> worker memory (with Redis)
        self.planner = planner
        self.index = index
        self.inflight = inflight
        self.metrics = metrics
        self.settings = settings
        self.hasher = PrefixHasher()
        ttl = settings.router.routed_prefix_s
        self.routed = RoutedPrefixes(ttl) if ttl > 0 else None
        self.session_prefixes = SessionPrefixes()

    async def views(self) -> list[WorkerView]:
        workers = self.registry.healthy()
        booked = await self.inflight.totals([w.worker_id for w in workers])
        now = self.registry.loop_lag.now()
        own = self.inflight.own
        return [v for w in workers
                if (v := worker_view(w, booked.get(w.worker_id, 0), now, own(w.worker_id))) is not None]

    def current(self, views: list[WorkerView]) -> list[WorkerView]:
        """`views` with this process's bookings and open legs as they are now. Between reading its
        views and picking, a request awaits the prefix lookup, its lineage and flow control; where
        those suspend (Redis-backed state, a flow-control wait) a burst's requests all read their
        views before any of them books, and planned and admitted on what they read they would see
        the same empty queues, herd onto one worker and pass admission together."""
        now, own, workers = self.registry.loop_lag.now(), self.inflight.own, self.registry.workers
        fresh = []
        for v in views:
            w, mine = workers.get(v.worker_id), own(v.worker_id)
            if w is None or (mine == v.own_booked and v.admitting == len(w.admitting)
                             and v.prefilling_since == scheduled_since(w)
                             and v.running == w.inflight + (w.load.running if w.load else 0)):
                fresh.append(v)  # nothing booked or opened since (a request alone): no copy
                continue
            fresh.append(worker_view(w, v.booked_tokens - v.own_booked + mine, now, mine) or v)
        return fresh

    async def candidates(self, prepared: PreparedRequest, cache_salt: str | None = None
                         ) -> tuple[list[WorkerView], dict[str, list[int]], Overlap]:
        """The views, the prompt's hashes per KV format (under `cache_salt`, the request's) and their
        overlap with each worker's cache."""
        views = await self.views()
        if not views:
            raise NoHealthyWorker("No healthy worker is available to serve this request; retry shortly.")
        with tracing.span("router.lookup", candidates=len(views)):
            hashes, overlap = await self.overlap(prepared, views, cache_salt)
        return views, hashes, overlap

    async def overlap(self, prepared: PreparedRequest, views: list[WorkerView],
                      cache_salt: str | None = None) -> tuple[dict[str, list[int]], Overlap]:
        """The prompt's hashes per KV format and their overlap with each of `views`' caches."""
        hashes = prompt_hashes(prepared.token_ids, views, self.hasher, prepared.packed_tokens, cache_salt)
        started = time.perf_counter()
        formats = {v.worker_id: v.kv_format for v in views}
        overlap = await self.index.lookup(hashes, formats)
        self.metrics.prefix_lookup.observe(time.perf_counter() - started)
        if self.routed is not None:
            overlap = self.routed.merged(overlap, hashes, formats, self.registry.loop_lag.now())
        return hashes, overlap

    def observe_session(self, session: SessionIdentity, hashes: Mapping[str, Sequence[int]]) -> None:
        """Count whether a named session's round extends its previous prompt (session_continuity.py)."""
        if session.session is not None:
            self.metrics.session_rounds.labels(self.session_prefixes.observe(session.session, hashes)).inc()

    async def lineage(self, session: SessionIdentity) -> Lineage | None:
        """The session's parent and, with a shared store, where it and its parent last went."""
        if self.affinity is not None:
            return await self.affinity.lineage(session)
        return Lineage(parent_key=session.parent) if session.parent is not None else None

    async def remember(self, session: SessionIdentity, plan: Plan) -> None:
        """The session's request went to the plan's worker: tell the other replicas."""
        if self.affinity is not None:
            await self.affinity.remember(session.session, plan.worker.worker_id)

    def admit(self, plan: Plan, views: list[WorkerView]) -> None:
        """Refuse (429 + Retry-After) when the chosen pool's queued prefill is over the budget."""
        pool = plan.worker.pool
        wait = retry_after(views, pool, self.settings.router.admission_queued_tokens,
                           lambda hardware: self.planner.hardware_cost(hardware).prefill_tokens_per_s)
        if wait is None:
            return
        queued = sum(v.queued_prefill_tokens for v in views if v.pool == pool)
        self.metrics.admission_rejections.labels(pool).inc()
        raise Overloaded(f"Pool {pool} is overloaded ({queued} queued prompt tokens); retry later.",
                         headers={"retry-after": str(wait)})

    def record(self, plan: Plan, request_id: str, hashes: Mapping[str, Sequence[int]]) -> None:
        """The request goes to the plan's worker (`hashes`: its prompt's, per KV format)."""
        w = plan.worker
        if self.routed is not None:
            self.routed.add(w.worker_id, hashes.get(w.kv_format, ()), self.registry.loop_lag.now())
        self.metrics.routing_decisions.labels(w.pool, w.hardware, str(plan.decision.reason)).inc()
        tracing.current_span().set_attributes({"route.mode": plan.mode, "route.worker": w.worker_id,
                                               "route.reason": str(plan.decision.reason)})
        if log.isEnabledFor(logging.DEBUG):
            log.debug("route %s mode=%s worker=%s reason=%s predicted=%d/%d costs=%s", request_id, plan.mode,
                      w.worker_id, plan.decision.reason, plan.decision.predicted_memory_tokens,
                      plan.decision.predicted_store_tokens, plan.decision.costs)
