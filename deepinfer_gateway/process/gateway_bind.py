"""Refuse to serve clients without authentication beyond loopback, unless told to.

With no API key configured (neither `api_keys` nor `api_keys_in_redis`) the gateway serves
anyone who reaches its port. On loopback that is the demo on one's own machine; on any other
address it is an open endpoint, so it takes `allow_unauthenticated` to say so, as a worker
refuses to listen beyond loopback without its token (worker_auth.check_bind).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from deepinfer_gateway.core.worker_auth import is_loopback

if TYPE_CHECKING:
    from deepinfer_gateway.config import GatewaySettings


def authenticates(settings: GatewaySettings) -> bool:
    return bool(settings.api_keys) or settings.api_keys_in_redis


def check_gateway_bind(settings: GatewaySettings) -> None:
    """SystemExit, saying what to set, for a keyless gateway beyond loopback not allowed to be one."""
    if authenticates(settings) or settings.allow_unauthenticated or is_loopback(settings.host):
        return
    raise SystemExit(f"a gateway listening on {settings.host} without API keys would serve anyone: configure "
                     "api_keys (or serve --api-key, or api_keys_in_redis), listen on 127.0.0.1, or set "
                     "allow_unauthenticated = true (serve --allow-unauthenticated) where an open endpoint is meant")
