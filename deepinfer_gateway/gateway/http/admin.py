"""The admin API under /admin: workers (list, add, remove), routing policies (read, switch)
and the prefix index's stats.

Every route needs a valid API key, one with admin rights when `admin_keys_required`.
Changes (workers added or removed, routing policies) go through `AdminSync` (admin_sync.py):
with `redis.url` every replica applies them, and a refused Redis write answers 503 with
nothing changed; without Redis they apply to the process that receives them. Reads
(`GET`) show this replica's view. Errors are GatewayErrors, rendered by the app's handler.

A worker added here must pass the allow-list (gateway/fleet/worker_allow.py): every call
to a worker carries the workers' token. Every change, and every refused one, is logged
(logger `deepinfer_gateway.admin`, at WARNING: the default level keeps it) with the
key that made it: its name and the first 8 hex digits of its SHA-256, never the key.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict
from starlette.responses import JSONResponse, Response

from deepinfer_gateway.config import ApiKey, GatewaySettings, parse_worker_spec
from deepinfer_gateway.core.errors import Forbidden, GatewayError
from deepinfer_gateway.gateway.fleet.client_ids import client_worker_id
from deepinfer_gateway.gateway.http.routes import authenticate
from deepinfer_gateway.gateway.state import gateway_state

audit = logging.getLogger("deepinfer_gateway.admin")


class RoutingUpdate(BaseModel):
    """Body of `PUT /admin/routing`: the policies to switch to (omitted ones stay), each a
    name or a table with parameters; the planner validates them."""

    model_config = ConfigDict(extra="forbid")
    policy: str | dict[str, Any] | None = None
    decode_policy: str | dict[str, Any] | None = None


def admin_router(settings: GatewaySettings) -> APIRouter:
    async def require_admin(request: Request) -> None:
        key = await authenticate(request)
        if not key.admin and settings.admin_keys_required:
            raise Forbidden("This endpoint needs an API key with admin rights.")
        request.state.admin_key = key

    router = APIRouter(prefix="/admin", dependencies=[Depends(require_admin)])

    @router.get("/workers")
    async def list_workers(request: Request) -> Response:
        state = gateway_state(request)
        return JSONResponse({"workers": [
            {"id": w.worker_id, "client_id": client_worker_id(w.spec),
             "url": w.url, "role": str(w.spec.role), "hardware": str(w.spec.hardware),
             "pool": w.pool, "kv_format": w.kv_format, "healthy": w.healthy, "draining": w.draining,
             "reported_id": w.info.worker_id if w.info else None,
             "inflight": w.inflight,
             "consecutive_failures": w.consecutive_failures, "kv_events_cursor": state.feeder.cursor(w.worker_id),
             "load": w.load.model_dump(mode="json") if w.load else None}
            for w in state.registry.workers.values()]})

    @router.post("/workers")
    async def add_worker(request: Request) -> Response:
        state = gateway_state(request)
        try:
            spec = parse_worker_spec(await request.body())
        except ValueError as exc:
            raise GatewayError(f"Invalid worker: {exc}", status_code=400) from None
        try:
            worker = await state.admin.add_worker(spec)
        except GatewayError as exc:
            _audit(request, "worker %s refused: %s", spec.worker_id, exc.message)
            raise
        _audit(request, "worker %s added (engine %s, role %s, pool %r)", spec.worker_id, spec.engine,
               spec.role, spec.pool)
        return JSONResponse({"id": worker.worker_id, "healthy": worker.healthy, "shared": state.admin.shared},
                            status_code=201)

    @router.delete("/workers/{worker_id:path}")
    async def remove_worker(worker_id: str, request: Request) -> Response:
        state = gateway_state(request)
        if not await state.admin.remove_worker(worker_id):
            raise GatewayError(f"No worker {worker_id}.", status_code=404)
        _audit(request, "worker %s removed", worker_id)
        return JSONResponse({"id": worker_id, "removed": True, "shared": state.admin.shared})

    @router.get("/index")
    async def index_stats(request: Request) -> Response:
        return JSONResponse(await gateway_state(request).index.stats())

    @router.get("/routing")
    async def get_routing(request: Request) -> Response:
        return JSONResponse(gateway_state(request).planner.describe())

    @router.put("/routing")
    async def set_routing(request: Request) -> Response:
        """Switch the routing policies (every replica's, with Redis)."""
        state = gateway_state(request)
        try:
            update = RoutingUpdate.model_validate_json(await request.body())
            await state.admin.set_routing(update.model_dump(exclude_none=True))
        except ValueError as exc:
            raise GatewayError(f"Invalid routing update: {exc}", status_code=400) from None
        _audit(request, "routing set: %s", update.model_dump_json(exclude_none=True))
        return JSONResponse(state.planner.describe())

    return router


def _audit(request: Request, message: str, *args: Any) -> None:
    """One admin change (or refusal), naming the key that asked for it."""
    key: ApiKey = request.state.admin_key
    key_id = key.key_sha256[:8]
    audit.warning("admin key %s (%s): " + message, key.name, key_id, *args,
                  extra={"admin_key": key.name, "admin_key_id": key_id})
