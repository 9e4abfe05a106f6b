"""Running ASGI apps under uvicorn with the process's own signal handling.

uvicorn's `run()` captures SIGINT/SIGTERM and re-raises them after shutdown, which
surfaces as a KeyboardInterrupt traceback inside the lifespan. Here the host decides:
SIGINT/SIGTERM set `should_exit`, uvicorn drains, and the call returns normally, so
callers' `finally` blocks (stopping child processes) run in order.

Draining in two steps: the first signal calls `on_signal` at once (the gateway's `/ready`
turns 503) and keeps the listener open for `drain_delay_s`, so load balancers that probe
readiness stop sending before the port closes; then uvicorn stops accepting, closes idle
connections and gives requests in flight `graceful_s` to finish. A second signal skips
the rest of the delay.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Callable, Iterator
from typing import Any

import uvicorn


# Idle keep-alive connections are held longer by servers than by the gateway's client pool
# (worker_client.POOL_KEEP_ALIVE_S), so the gateway never writes into a connection the
# worker is closing (the "Server disconnected" race of uvicorn's 5 s default).
KEEP_ALIVE_S = 75


class EmbeddedServer(uvicorn.Server):
    """A uvicorn server that leaves signal handling to its host (several may run at once)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def serve_until_signal(app: Any, host: str, port: int, *, log_level: str = "info",
                             graceful_s: float = 30.0, drain_delay_s: float = 0.0,
                             on_signal: Callable[[], None] | None = None) -> None:
    # log_config=None: uvicorn's loggers propagate to the root handler the CLI installed
    # (gateway/logs.py), so `--log-format json` covers uvicorn's lines too.
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level.lower(), access_log=False,
                            timeout_graceful_shutdown=graceful_s, lifespan="on", log_config=None,
                            timeout_keep_alive=KEEP_ALIVE_S)
    server = EmbeddedServer(config)
    loop = asyncio.get_running_loop()
    delayed_exit: list[asyncio.TimerHandle] = []

    def begin_shutdown() -> None:
        if delayed_exit or drain_delay_s <= 0:
            server.should_exit = True
            return
        delayed_exit.append(loop.call_later(drain_delay_s, setattr, server, "should_exit", True))

    def on_exit_signal() -> None:
        if on_signal is not None:
            on_signal()
        begin_shutdown()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_exit_signal)
    try:
        await server.serve()
    finally:
        for handle in delayed_exit:
            handle.cancel()


def run_until_signal(app: Any, host: str, port: int, **kwargs: Any) -> None:
    try:
        import uvloop

        uvloop.run(serve_until_signal(app, host, port, **kwargs))
    except ImportError:
        asyncio.run(serve_until_signal(app, host, port, **kwargs))
