"""Running ASGI apps under uvicorn with the process's own signal handling.

uvicorn's `run()` captures SIGINT/SIGTERM and re-raises them after shutdown, which
surfaces as a KeyboardInterrupt traceback inside the lifespan. Here the host decides:
SIGINT/SIGTERM set `should_exit`, uvicorn drains, and the call returns normally, so
callers' `finally` blocks (stopping child processes) run in order.

Draining in two steps: the first signal calls `on_signal` at once (the gateway's `/ready`
turns 503) and keeps the listener open for `drain_delay_s`, so load balancers that probe
readiness stop sending before the port closes; then uvicorn stops accepting, closes idle
connections and gives requests in flight `graceful_s` to finish. A second signal skips
the rest of the delay, except in a supervised process: one stop reaches it twice there
(the process group's signal and the supervisor's forward of it, two deliveries or one as
the kernel merges them), so repeats are ignored and only `skip_delay_signals` (which the
supervisor sends for its own second signal) skip the delay.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import signal
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from email.utils import formatdate
from typing import Any, cast

import uvicorn

from deepinfer_gateway.core.protocol import MAX_MUX_MESSAGE_BYTES
from deepinfer_gateway.infra.http_bounds import ConnectionBounds, bounded_http_protocol

# Idle keep-alive connections are held longer by servers than by the gateway's client pool
# (gateway/upstream/http.py POOL_KEEP_ALIVE_S), so the gateway never writes into a connection the
# worker is closing (the "Server disconnected" race of uvicorn's 5 s default).
KEEP_ALIVE_S = 75


class EmbeddedServer(uvicorn.Server):
    """A uvicorn server that leaves signal handling to its host (several may run at once).

    `freeze_heap`: once started, move every object alive (tokenizer tables, the app) to the
    collector's permanent generation and collect young objects less often. A serving process
    allocates a few containers per request and per relayed token, so without this full
    collections keep walking the start-up heap: measured with bench/gateway_capacity.py
    against the same tree without it, CPU per short request 0.49 vs 0.55 ms and added p99
    latency 11-13 vs 11-45 ms. Process-wide: only a process's own server sets it."""

    def __init__(self, config: uvicorn.Config, freeze_heap: bool = False):
        self._wake: asyncio.Event | None = None
        super().__init__(config)
        self.freeze_heap = freeze_heap
        self.server_state.connections = _Connections(self._first_connection)

    @property
    def should_exit(self) -> bool:
        return self._should_exit

    @should_exit.setter
    def should_exit(self, value: bool) -> None:
        """Set on the loop's thread (its signal handlers, timers, `ServedApp.stop`): wakes `main_loop`."""
        self._should_exit = value
        if value and self._wake is not None:
            self._wake.set()

    async def main_loop(self) -> None:
        """uvicorn's loop, woken once a second (its Date header's resolution) instead of every
        100 ms while connections are open, not at all while none is (the first one refreshes
        the Date header itself), and at once when `should_exit` is set: an idle process runs no
        timer of its own."""
        self._wake = wake = asyncio.Event()
        counter = 0
        should_exit = await self.on_tick(counter)
        while not should_exit:
            counter = (counter + 10) % 864000  # on_tick counts tenths of a second
            wake.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(1.0 if self.server_state.connections else None):
                    await wake.wait()
            should_exit = await self.on_tick(counter)

    def _first_connection(self) -> None:
        """A connection opens while none was: the Date header may be stale, and ticks resume."""
        date = formatdate(time.time(), usegmt=True).encode()
        self.server_state.default_headers = ([(b"date", date)] if self.config.date_header else []
                                             ) + self.config.encoded_headers
        if self._wake is not None:
            self._wake.set()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started and self.freeze_heap:
            gc.collect()
            gc.freeze()
            gc.set_threshold(20_000, 20, 20)


class _Connections(set[Any]):
    """uvicorn's set of a server's open connections; adding the first calls `on_first`."""

    def __init__(self, on_first: Callable[[], None]) -> None:
        super().__init__()
        self._on_first = on_first

    def add(self, connection: Any) -> None:
        if not self:
            self._on_first()
        super().add(connection)


async def serve_until_signal(app: Any, host: str, port: int, *, log_level: str = "info",
                             graceful_s: float = 30.0, drain_delay_s: float = 0.0,
                             on_signal: Callable[[], None] | None = None, sock: socket.socket | None = None,
                             headers: Sequence[tuple[str, str]] = (),
                             signals: Sequence[signal.Signals] = (signal.SIGINT, signal.SIGTERM),
                             skip_delay_signals: Sequence[signal.Signals] | None = None,
                             bounds: ConnectionBounds | None = None) -> bool:
    """Serve until one of `signals`; returns whether the server started (False: the lifespan
    failed). `sock`: a listening socket bound by the caller (a supervisor shares one between
    its processes), else uvicorn binds `host`:`port`. `headers` go on every response.
    `skip_delay_signals`: None: a repeat of `signals` skips the rest of the drain delay; else
    repeats are ignored and these skip it (module doc). `bounds`: on each connection's request
    heads and on the number of connections (http_bounds.py); none: uvicorn's defaults."""
    # log_config=None: uvicorn's loggers propagate to the root handler the CLI installed
    # (gateway/telemetry/logs.py), so `--log-format json` covers uvicorn's lines too.
    # uvicorn hints timeout_graceful_shutdown as int, but hands it to asyncio.timeout: seconds as float.
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level.lower(), access_log=False,
                            timeout_graceful_shutdown=cast(int, graceful_s), lifespan="on", log_config=None,
                            timeout_keep_alive=KEEP_ALIVE_S, headers=list(headers), ws_max_size=MAX_MUX_MESSAGE_BYTES,
                            **_bounded(bounds))
    server = EmbeddedServer(config, freeze_heap=True)
    loop = asyncio.get_running_loop()
    delayed_exit: list[asyncio.TimerHandle] = []

    def begin_shutdown() -> None:
        if delayed_exit or drain_delay_s <= 0:
            server.should_exit = True
            return
        delayed_exit.append(loop.call_later(drain_delay_s, setattr, server, "should_exit", True))

    def on_exit_signal() -> None:
        if delayed_exit and skip_delay_signals is not None:
            return  # the stop already under way, delivered again
        if on_signal is not None:
            on_signal()
        begin_shutdown()

    def on_skip_delay_signal() -> None:
        if on_signal is not None:
            on_signal()
        server.should_exit = True

    for sig in signals:
        loop.add_signal_handler(sig, on_exit_signal)
    for sig in skip_delay_signals or ():
        loop.add_signal_handler(sig, on_skip_delay_signal)
    try:
        await server.serve(sockets=[sock] if sock is not None else None)
    finally:
        for handle in delayed_exit:
            handle.cancel()
    return server.started


def _bounded(bounds: ConnectionBounds | None) -> dict[str, Any]:
    if bounds is None:
        return {}
    return {"http": bounded_http_protocol(bounds), "limit_concurrency": bounds.max_connections}


def run_until_signal(app: Any, host: str, port: int, **kwargs: Any) -> bool:
    """serve_until_signal in a new event loop (uvloop where installed)."""
    try:
        import uvloop

        return uvloop.run(serve_until_signal(app, host, port, **kwargs))
    except ImportError:
        return asyncio.run(serve_until_signal(app, host, port, **kwargs))


@dataclass
class ServedApp:
    server: uvicorn.Server
    task: asyncio.Task[None]
    host: str
    port: int

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def stop(self) -> None:
        self.server.should_exit = True
        await self.task


async def serve_app(app: Any, host: str = "127.0.0.1", port: int = 0) -> ServedApp:
    """Serve `app` in the running loop; returns once it accepts connections."""
    # proto=IPPROTO_TCP matters: asyncio only sets TCP_NODELAY on accepted sockets whose
    # proto says TCP, and without it Nagle + delayed ACK add ~40 ms to fast replies.
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=2, lifespan="on",
                            timeout_keep_alive=KEEP_ALIVE_S, ws_max_size=MAX_MUX_MESSAGE_BYTES)
    server = EmbeddedServer(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            task.result()  # raises the start-up error
            raise RuntimeError(f"server on {host}:{port} exited during start-up")
        await asyncio.sleep(0.01)
    return ServedApp(server, task, host, sock.getsockname()[1])
