"""The request path after parsing: route -> worker(s) -> relay tokens -> protocol response.

One job per module: route_inputs.py (what the planner sees, admission), legs.py (open,
retry, PD hand-off; a `Lease` per leg), relay.py (SSE relay, non-stream drain, the end of
a request). `RequestServer.serve` strings them together.

The client's response starts only once the first token is in hand, so every failure
before it can become a retry or a proper HTTP error status. From the moment a worker call
opens, exactly one owner ends it: `Relay.close` in this function's `finally`, or, once a
stream is returned as a `RelayResponse`, that response (its `on_close` runs however it
ends; its disconnect watcher cancels the body when the client goes away).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

from starlette.responses import Response

from deepinfer_gateway.config import GatewaySettings
from deepinfer_gateway.core import headers as names
from deepinfer_gateway.core.session_identity import SessionIdentity
from deepinfer_gateway.gateway.fleet.client_ids import client_worker_id, digest_of
from deepinfer_gateway.gateway.fleet.registry import WorkerRegistry
from deepinfer_gateway.gateway.serving.flow_gate import FlowGate, FlowTicket
from deepinfer_gateway.gateway.serving.legs import Legs
from deepinfer_gateway.gateway.serving.outcome import RequestOutcome
from deepinfer_gateway.gateway.serving.relay import Exchange, Relay, RelayResponse
from deepinfer_gateway.gateway.serving.route_inputs import RouteInputs
from deepinfer_gateway.gateway.serving.session_gate import SessionGate, reported_capacity
from deepinfer_gateway.gateway.serving.shared_affinity import SharedAffinity
from deepinfer_gateway.gateway.telemetry.decision_log import DecisionLog, decision_record
from deepinfer_gateway.gateway.telemetry.logs import random_id
from deepinfer_gateway.gateway.telemetry.metrics import GatewayMetrics
from deepinfer_gateway.gateway.upstream.base import LegRequest
from deepinfer_gateway.kvcache.types import PrefixIndex
from deepinfer_gateway.recipe_bridge.prepare import PreparedRequest
from deepinfer_gateway.recipe_bridge.stream import ID_PREFIX, response_stream
from deepinfer_gateway.recipe_bridge.tokenizer import TokenizerBundle
from deepinfer_gateway.router.inflight import MemoryInflight, RedisInflight
from deepinfer_gateway.router.planner import Mode, RoutePlanner

SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


class RequestServer:
    """Serves a prepared request on the workers and answers it in the client's protocol."""

    def __init__(self, registry: WorkerRegistry, planner: RoutePlanner, index: PrefixIndex,
                 inflight: MemoryInflight | RedisInflight, bundle: TokenizerBundle, metrics: GatewayMetrics,
                 settings: GatewaySettings, affinity: SharedAffinity | None = None, redis: Any = None):
        """`redis`: the replicas' (flow control's fair share, sessions' capacity: shared)."""
        self.routing = RouteInputs(registry, planner, index, inflight, metrics, settings, affinity)
        self.gate = (FlowGate(settings.flow_control, self.routing.views,
                              lambda hardware: planner.hardware_cost(hardware).prefill_tokens_per_s, metrics,
                              redis=redis)
                     if settings.flow_control.enabled else None)
        self.sessions = (SessionGate(settings.session_capacity, reported_capacity(registry), metrics, redis)
                         if settings.session_capacity.enabled else None)
        self.legs = Legs(registry, self.routing, metrics, settings, self.gate, self.sessions)
        self.relay = Relay(self.legs, registry)
        self.bundle = bundle
        self.metrics = metrics
        self.loop_lag = registry.loop_lag
        path = settings.router.decision_log
        self.decisions = DecisionLog(path) if path else None

    def _client_id(self, worker_id: str) -> str:
        worker = self.legs.registry.workers.get(worker_id)
        return client_worker_id(worker.spec) if worker is not None else digest_of(worker_id)

    @property
    def planner(self) -> RoutePlanner:
        return self.routing.planner

    @property
    def index(self) -> PrefixIndex:
        return self.routing.index

    async def serve(self, prepared: PreparedRequest, request_id: str, arrival: float, *,
                    workload_class: str = "chat", headers: dict[str, str] | None = None,
                    on_done: Callable[[int], None] | None = None, session: SessionIdentity | None = None,
                    cache_salt: str | None = None, flow: FlowTicket | None = None,
                    response_id: str | None = None) -> Response:
        """`on_done(completion_tokens)` runs once when the request ends, however it ends, if it
        reached a worker. `cache_salt`: the request's prefix-cache salt (cache_salt.py). `flow`:
        its flow-control ticket (flow_gate.py), when flow control is on."""
        # The workers get an id of ours: a client's x-request-id (`request_id`, echoed and logged)
        # is not unique, and two requests with the same one would collide on a worker.
        leg = LegRequest(random_id(), prepared.token_ids,
                         prepared.sampling.model_dump(by_alias=True, exclude_defaults=True), workload_class,
                         images=prepared.images or None, image_token_adjustment=prepared.image_token_adjustment,
                         cache_salt=cache_salt, priority=flow.tier.engine_priority if flow is not None else 0)
        # `response_id`: one chosen before it runs (a background response's)
        response = response_stream(prepared, self.bundle,
                                   response_id or ID_PREFIX[prepared.protocol] + uuid.uuid4().hex)
        if session is None or session.session is None:
            session = SessionIdentity(prepared.user)
        lease, plan, ready, first, views = await self.legs.first(prepared, leg, session,
                                                                 flow, arrival)
        if self.sessions is not None:  # the round ends when its exchange closes: its session's TTL starts
            on_done = self.sessions.ending(leg.request_id, on_done)
        if flow is not None:
            met = time.perf_counter() - arrival <= flow.target_s
            self.metrics.flow_ttft.labels(flow.tier.label, "true" if met else "false").inc()
        if self.decisions is not None:
            now = time.perf_counter()
            stall = self.loop_lag.own_stall_s(self.loop_lag.now() - (now - arrival))
            self.decisions.write(decision_record(plan, request_id, ready, arrival=arrival, ready_at=lease.ready_at,
                                                 first_at=now, loop_stall_s=stall, views=views))
        # `lease.worker`: already the decode worker when a prefill handed off before any token (vLLM)
        outcome = RequestOutcome(self.metrics, prepared, plan, arrival, ready, lease.worker)
        exchange = Exchange(prepared=prepared, leg=leg, lease=lease, response=response, outcome=outcome,
                            keep_ids=plan.mode is Mode.PD, on_done=on_done)
        streaming = False
        try:
            cached = ready["cached_tokens"]
            exchange.head = response.ready(ready["prompt_tokens"], cached["memory"] + cached["store"])
            outcome.started(lease.ready_at)
            exchange.pending.append(first)
            headers = {**(headers or {}), names.REQUEST_ID: request_id,
                       names.WORKER: self._client_id(plan.worker.worker_id)}
            if prepared.stream:
                streaming = True  # from here on RelayResponse owns the end
                return RelayResponse(self.relay.stream(exchange), on_close=lambda: self.relay.close_stream(exchange),
                                     media_type="text/event-stream", headers={**SSE_HEADERS, **headers})
            outcome.first_token(time.perf_counter())
            await self.relay.drain(exchange)
            return Response(response.body(), media_type="application/json", headers=headers)
        finally:
            if not streaming:
                self.relay.close(exchange)
