"""One gateway process: the app as it is served (request context, server spans, the app) and
serving it until a stop signal. `cli_commands.run_gateway` runs one in the foreground;
`supervisor.child_main` runs one per supervised child. Imports are inside the functions so
the CLI's `--help` stays fast.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from deepinfer_gateway.config import GatewaySettings


def configure_logging(level: str, fmt: str) -> None:
    """Root logging set-up; imported here, not at the top, because it loads the gateway package."""
    from deepinfer_gateway.gateway.telemetry.logs import configure_logging as configure

    configure(level, fmt)


def gateway_app(settings: GatewaySettings) -> tuple[Any, threading.Event]:
    """The gateway as served (app, server spans, request context) and the event that turns
    its `/ready` to 503: set by the stop signal."""
    from deepinfer_gateway.core import tracing
    from deepinfer_gateway.gateway.app import create_app
    from deepinfer_gateway.gateway.telemetry.logs import RequestContext, current_request_id

    shutting_down = threading.Event()
    spans = tracing.ServerSpans(create_app(settings, shutting_down=shutting_down),
                                request_id=lambda _scope: current_request_id())
    return RequestContext(spans, access=settings.access_log), shutting_down


def serve_gateway(app: Any, shutting_down: threading.Event, settings: GatewaySettings, log_level: str,
                  **options: Any) -> bool:
    """Serve until a stop signal, draining as the settings say; True if the app started.
    `options`: asgi.serve_until_signal's (a supervisor's shared `sock`, `headers`, `signals`)."""
    from deepinfer_gateway.infra.asgi import run_until_signal
    from deepinfer_gateway.infra.http_bounds import ConnectionBounds

    limits = settings.client_connections
    bounds = ConnectionBounds(limits.header_timeout_s, limits.max_header_bytes, limits.max_connections,
                              limits.write_timeout_s)
    return run_until_signal(app, settings.host, settings.port, log_level=log_level,
                            graceful_s=settings.shutdown_grace_s, drain_delay_s=settings.shutdown_delay_s,
                            on_signal=shutting_down.set, bounds=bounds, **options)
