"""What the app's lifespan builds and the routes read: `GatewayState`, at
`request.app.state.gateway` (app.create_app). Imports only what it holds: the routes and the
admin API import it, never app.py."""

from __future__ import annotations

from dataclasses import dataclass

from starlette.requests import Request

from deepinfer_gateway.gateway.fleet.admin_sync import AdminSync
from deepinfer_gateway.gateway.fleet.registry import WorkerRegistry
from deepinfer_gateway.gateway.serving.auth import KeyStore
from deepinfer_gateway.gateway.serving.conversations_api import ConversationsState
from deepinfer_gateway.gateway.serving.ratelimit import MemoryRateLimiter, RedisRateLimiter
from deepinfer_gateway.gateway.serving.responses_api import ResponsesState
from deepinfer_gateway.gateway.serving.server import RequestServer
from deepinfer_gateway.kvcache.events import KvEventFeeder
from deepinfer_gateway.kvcache.types import PrefixIndex
from deepinfer_gateway.router.planner import RoutePlanner


@dataclass
class GatewayState:
    registry: WorkerRegistry
    server: RequestServer
    keys: KeyStore
    limiter: MemoryRateLimiter | RedisRateLimiter
    feeder: KvEventFeeder
    started_at: int
    admin: AdminSync
    responses: ResponsesState
    conversations: ConversationsState

    @property
    def index(self) -> PrefixIndex:
        return self.server.index

    @property
    def planner(self) -> RoutePlanner:
        return self.server.planner


def gateway_state(request: Request) -> GatewayState:
    """What the lifespan built (app.create_app)."""
    state: GatewayState = request.app.state.gateway
    return state
