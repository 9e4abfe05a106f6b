"""Serving an ASGI app under granian (a Rust HTTP server) in this process's event loop: the
trial alternative to asgi.py's uvicorn host, chosen by the gateway's `http_server` setting.

granian's embedded server (granian.server.embed, marked experimental upstream) runs one
worker as a task of the running loop: it runs the app's lifespan, then Rust threads own the
sockets and parse HTTP/1.1, and the app runs on this loop as under uvicorn. Stopping
follows asgi.serve_until_signal's two steps: the first signal calls `on_signal` (`/ready`
turns 503) and the listener stays open `drain_delay_s`, a second skips the rest of the
delay. Of http_bounds.py's bounds it has the head's read timeout (the connection closes,
without a 408) and, for the connection count, granian's `backpressure`: requests in flight
past which it stops accepting (the rest wait in the listen backlog, no 503).

What it does not have beside uvicorn's host: a caller's socket (the supervisor's shared one),
a bound on how long streams in flight get once stopping (granian waits for them all), a
bound on a head's size (a 100 KB header is served), the write timeout of a client that stops
reading, and extra response headers. Measured against uvicorn on the same app
(bench/relay_peer_cpu.py --servers uvicorn,granian), it costs more CPU per relayed chunk and
per request: its Rust thread takes work off the event loop's thread, but more than that in
its own thread and in the hand-offs between the two.
"""

from __future__ import annotations

import asyncio
import gc
import signal
from collections.abc import Callable, Sequence
from typing import Any

from deepinfer_gateway.infra.http_bounds import ConnectionBounds

Scope = dict[str, Any]


def _hosted(app: Any, started: asyncio.Event) -> Any:
    """The app as granian calls it. Its `send` returns a coroutine, as uvicorn's does: the
    relay's direct path drives a write's coroutine by hand (gateway/serving/relay.py `_sink`),
    and granian's own `send` returns a Rust awaitable with no `send`/`throw`. Its lifespan
    freezes the heap once start-up completes (asgi.EmbeddedServer's `freeze_heap`, so both
    hosts run on the same collector settings) and sets `started` (granian logs a failed
    start-up and returns without raising)."""

    async def wrapped(scope: Scope, receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        if scope["type"] != "lifespan":

            async def coroutine_send(message: dict[str, Any]) -> None:
                await send(message)

            await app(scope, receive, coroutine_send)
            return

        async def send_then_freeze(message: dict[str, Any]) -> None:
            await send(message)
            if message["type"] == "lifespan.startup.complete":
                gc.collect()
                gc.freeze()
                gc.set_threshold(20_000, 20, 20)
                started.set()

        await app(scope, receive, send_then_freeze)

    return wrapped


async def serve_until_signal(app: Any, host: str, port: int, *, log_level: str = "info",
                             drain_delay_s: float = 0.0, on_signal: Callable[[], None] | None = None,
                             signals: Sequence[signal.Signals] = (signal.SIGINT, signal.SIGTERM),
                             bounds: ConnectionBounds | None = None) -> bool:
    """Serve `app` on `host`:`port` until one of `signals`; returns whether it started (False:
    the lifespan failed)."""
    from granian.constants import HTTPModes, Interfaces
    from granian.http import HTTP1Settings
    from granian.log import LogLevels
    from granian.server.embed import Server

    level = LogLevels(log_level.lower())
    # granian configures logging itself (dictConfig): its loggers propagate to the root handler
    # the CLI installed instead of printing to stdout in a format of their own.
    log_config = {"loggers": {name: {"handlers": [], "level": level.name.upper(), "propagate": True}
                              for name in ("_granian", "granian.access")}}
    http1 = HTTP1Settings(header_read_timeout=int(1000 * bounds.header_timeout_s)) if bounds else HTTP1Settings()
    started = asyncio.Event()
    server = Server(_hosted(app, started), address=host, port=port, interface=Interfaces.ASGI,
                    http=HTTPModes.http1, http1_settings=http1, websockets=True, runtime_threads=1,
                    blocking_threads=1, log_level=level, log_dictconfig=log_config,
                    # granian's default is its listen backlog (128): that many requests at once
                    backpressure=bounds.max_connections if bounds is not None else None)
    stop: Callable[[], None] = server.stop
    loop = asyncio.get_running_loop()
    delayed_stop: list[asyncio.TimerHandle] = []

    def on_exit_signal() -> None:
        if on_signal is not None:
            on_signal()
        if delayed_stop or drain_delay_s <= 0:
            stop()
            return
        delayed_stop.append(loop.call_later(drain_delay_s, stop))

    for sig in signals:
        loop.add_signal_handler(sig, on_exit_signal)
    try:
        await server.serve()
    finally:
        for handle in delayed_stop:
            handle.cancel()
        for sig in signals:
            loop.remove_signal_handler(sig)
    return started.is_set()


def run_until_signal(app: Any, host: str, port: int, **kwargs: Any) -> bool:
    """serve_until_signal in a new uvloop event loop."""
    import uvloop

    return uvloop.run(serve_until_signal(app, host, port, **kwargs))
