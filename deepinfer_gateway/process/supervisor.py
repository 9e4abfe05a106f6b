"""Several gateway processes behind one port on one host: `serve --processes N`.

The supervisor binds the listening sockets and hands them to N child processes, each a
whole gateway (gateway_process.serve_gateway) accepting from its slot's socket. Children are
started with multiprocessing's spawn context: a fresh interpreter each, nothing forked
from a process that holds threads or an event loop.

One listening socket per slot, all on one port with SO_REUSEPORT (Linux): the kernel
spreads new connections over them by address hash, as nginx's `reuseport` does. One socket
shared by every process was measured to leave one process with every connection of a burst:
16 keep-alive connections opened at once all went to one of two processes in 5 of 6 runs (the
first process woken drains the whole accept queue; uvloop accepts until it is empty, and
UV_TCP_SINGLE_ACCEPT did not change that), so two processes served like one.

The supervisor binds each slot's socket (so the port is taken, and a bind error stops it
before any child starts) without listening: the child's server listens once its app has
started, and only then does the kernel hash connections to it. When a slot's process dies
the supervisor closes its copy of the socket, which takes the slot out of the balancing, and
binds a fresh one for the replacement. So no new connection waits for a process that is
starting or restarting: held open, a dead slot's socket kept its share of new connections
waiting for the replacement, its restart delay (up to MAX_RESTART_DELAY_S for a slot whose
processes keep dying young) plus its start-up (~1.7 s here: the tokenizer loads).
Connections queued on a dead slot's socket are reset, as the dead process's own are, and one
whose handshake races the close is refused: clients retry (with the sysctl
`net.ipv4.tcp_migrate_req=1`, Linux 5.14+, the kernel moves them to a live socket instead).
A keep-alive connection stays with the process that accepted it. Where SO_REUSEPORT does
not balance (not Linux), all processes share one socket, held for the supervisor's whole life.

uvicorn.supervisors.Multiprocess is not used: its children run uvicorn's own signal
handling (no `/ready` 503 and no drain delay), it restarts a dead child at once (a crash
loop spins), it waits for children without a deadline at shutdown, and it has no hook
where a child exits (prometheus-client's `mark_process_dead`).

What the processes share goes through Redis: `redis.url`, else a Redis-compatible server
that the supervisor starts on a Unix socket in a private directory (redis_process.py),
hands to the children as `unix://…/redis.sock`, and stops after the last child. With
neither, N > 1 is a configuration error: per-process rate limits and indexes would
silently multiply by N.

Metrics: before the first child starts, PROMETHEUS_MULTIPROC_DIR names a fresh private
directory (removed at exit), so each child's metrics are files there that /metrics can
add up (prometheus-client's multiprocess mode); a child that exits is marked dead.

Signals: SIGTERM or SIGINT is forwarded as SIGTERM to every child, which drains as a
single gateway does (`/ready` 503, `shutdown_delay_s`, then `shutdown_grace_s` for
requests in flight); a second one is forwarded as SKIP_DELAY_SIGNAL (the children skip
the rest of the delay). A child ignores SIGTERMs after its first: a stop sent to the
whole process group (systemd's default KillMode, `kill -TERM -PGID`) reaches it directly
and again through this forward, and read as a second stop it would close its port at
once, before load balancers saw `/ready` turn 503. Children past the drain plus a margin
are killed. Children ignore SIGINT: a terminal's Ctrl-C reaches the whole process group,
and the supervisor decides.

A child that dies is replaced after `restart_delay_s` (0 s, then doubling up to 30 s while
replacements keep dying young); one whose app never started (lifespan or set-up error) stops
the supervisor with exit code 1, as the same settings would fail the same way again.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from typing import Any, Literal

from deepinfer_gateway.config import ConfigError, GatewaySettings
from deepinfer_gateway.core import headers

log = logging.getLogger(__name__)

PROCESS_HEADER = headers.PROCESS
STARTUP_FAILURE = 3  # a child's exit status when its app never started (uvicorn's value)
STABLE_AFTER_S = 30.0  # a child that lived this long resets its slot's restart backoff
MAX_RESTART_DELAY_S = 30.0
STOP_MARGIN_S = 5.0  # past the drain (delay + grace), remaining children are killed
SKIP_DELAY_SIGNAL = signal.SIGUSR1  # to the children: the supervisor's second stop signal


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask, e.g. a container's cpuset)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def resolve_processes(value: int | Literal["auto"], cpus: int | None = None) -> int:
    """The `processes` setting as a count: "auto" and 0 mean one per available CPU."""
    if value == "auto" or value == 0:
        return max(1, cpus if cpus is not None else available_cpus())
    return int(value)


def restart_delay_s(failures: int) -> float:
    """Wait before replacing a child, after `failures` consecutive early deaths in its slot:
    the first replacement is immediate, then 1, 2, 4... s up to MAX_RESTART_DELAY_S."""
    if failures <= 1:
        return 0.0
    return min(MAX_RESTART_DELAY_S, 2.0 ** (failures - 2))


def bind_listeners(host: str, port: int, count: int) -> list[socket.socket]:
    """`count` sockets bound to one port, balanced by the kernel once listening (SO_REUSEPORT,
    Linux), or one socket for all where that does not balance; `port` 0 picks a free port for
    all. Not listening yet: a child's server listens once its app has started, so the kernel
    hands no connection to a socket whose process cannot take it yet."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    reuse_port = sys.platform.startswith("linux") and hasattr(socket, "SO_REUSEPORT") and count > 1
    socks: list[socket.socket] = []
    try:
        for _ in range(count if reuse_port else 1):
            socks.append(bind_listener(family, address, reuse_port))
            address = socks[-1].getsockname()  # the port 0 chose, for the others
    except OSError:
        for sock in socks:
            sock.close()
        raise
    return socks


def bind_listener(family: int, address: Any, reuse_port: bool) -> socket.socket:
    """One socket bound to `address`, not listening; with `reuse_port`, one of a SO_REUSEPORT
    group (TCP sockets join the group's balancing when they listen)."""
    # proto=IPPROTO_TCP: asyncio sets TCP_NODELAY only on accepted sockets whose proto says TCP.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


@dataclass
class _Slot:
    index: int
    process: BaseProcess | None = None
    started_at: float = 0.0
    failures: int = 0  # consecutive deaths before STABLE_AFTER_S
    restart_at: float | None = None


class Supervisor:
    def __init__(self, settings: GatewaySettings, processes: int, *, log_level: str, log_format: str) -> None:
        self.settings = settings
        self.processes = processes
        self.log_level = log_level
        self.log_format = log_format
        self.slots = [_Slot(i) for i in range(processes)]
        self.stopping = False
        self.exit_code = 0
        self._kill_at: float | None = None
        self._signals: list[int] = []
        self._context = multiprocessing.get_context("spawn")

    def run(self) -> int:
        """Serve until SIGTERM/SIGINT; returns the exit status. Raises ConfigError."""
        with contextlib.ExitStack() as stack:
            child_settings = self._shared_state(stack)
            try:
                self._socks: list[socket.socket | None] = list(
                    bind_listeners(self.settings.host, self.settings.port, self.processes))
            except OSError as e:
                log.error("cannot listen on %s:%s: %s", self.settings.host, self.settings.port, e)
                return 1
            stack.callback(self._close_listeners)
            first = self._socks[0]
            assert first is not None
            self._family, self._address = first.family, first.getsockname()
            self._metrics_dir = stack.enter_context(_metrics_directory())
            stack.enter_context(self._signal_wakeup())
            host, port = self._address[:2]
            log.info("supervisor %d: %d gateway processes on %s:%d", os.getpid(), self.processes, host, port)
            for slot in self.slots:
                self._start(slot, child_settings)
            try:
                self._loop(child_settings)
            finally:
                self._kill_all()
        return self.exit_code

    def _shared_state(self, stack: contextlib.ExitStack) -> GatewaySettings:
        """The children's settings: the configured Redis, else one started here for them."""
        updates: dict[str, Any] = {"processes": 1}
        if not self.settings.redis.url:
            if self.settings.redis.cluster:
                raise ConfigError([("redis.cluster", "needs redis.url")])
            from deepinfer_gateway.infra.redis_process import NoRedisServerBinary, RedisProcess

            server = RedisProcess(unix_socket=True, dies_with_parent=True)
            try:
                server.start()
            except NoRedisServerBinary as e:
                raise ConfigError([("processes", f"{self.processes} processes share their state through Redis: "
                                                 f"set redis.url, or make a Redis server available ({e})")]) from None
            stack.callback(server.stop)
            log.info("shared state: Redis at %s (pid %s)", server.url, server.proc.pid if server.proc else "?")
            # A private socket: no password.
            updates["redis"] = self.settings.redis.model_copy(update=dict(url=server.url, password=None,
                                                                          password_file=None))
        return self.settings.model_copy(update=updates)

    @contextlib.contextmanager
    def _signal_wakeup(self) -> Iterator[None]:
        """SIGTERM/SIGINT queue themselves and wake the loop through a pipe."""
        self._wake_r, wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(wake_w, False)
        previous_fd = signal.set_wakeup_fd(wake_w)
        previous = {sig: signal.signal(sig, lambda signum, _frame: self._signals.append(signum))
                    for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            signal.set_wakeup_fd(previous_fd)
            os.close(self._wake_r)
            os.close(wake_w)

    def _start(self, slot: _Slot, settings: GatewaySettings) -> None:
        sock = self._slot_socket(slot)
        if sock is None:
            self._schedule_restart(slot)
            return
        process = self._context.Process(target=child_main, name=f"dgw-gateway-{slot.index}", daemon=False,
                                        args=(settings, self.log_level, self.log_format, sock))
        process.start()
        slot.process, slot.started_at, slot.restart_at = process, time.monotonic(), None
        log.info("gateway process %d started (slot %d)", process.pid, slot.index)

    def _loop(self, settings: GatewaySettings) -> None:
        while True:
            live = [slot for slot in self.slots if slot.process is not None]
            if self.stopping and not live:
                return
            waits: list[Any] = [slot.process.sentinel for slot in live if slot.process is not None]
            multiprocessing.connection.wait([*waits, self._wake_r], timeout=self._next_deadline())
            with contextlib.suppress(BlockingIOError):
                while os.read(self._wake_r, 512):
                    pass
            while self._signals:
                self._on_signal(self._signals.pop(0))
            for slot in live:
                if slot.process is not None and slot.process.exitcode is not None:
                    self._on_exit(slot)
            now = time.monotonic()
            for slot in self.slots:
                if not self.stopping and slot.restart_at is not None and slot.restart_at <= now:
                    self._start(slot, settings)
            if self._kill_at is not None and now >= self._kill_at:
                log.warning("gateway processes still running %.0fs after SIGTERM: killing them",
                            now - self._kill_at + STOP_MARGIN_S)
                self._kill_all()
                self._kill_at = None

    def _next_deadline(self) -> float | None:
        times = [slot.restart_at for slot in self.slots if slot.restart_at is not None and not self.stopping]
        if self._kill_at is not None:
            times.append(self._kill_at)
        return max(0.0, min(times) - time.monotonic()) if times else None

    def _on_signal(self, signum: int) -> None:
        forward = SKIP_DELAY_SIGNAL if self.stopping else signal.SIGTERM
        if not self.stopping:
            log.info("supervisor: %s, draining %d gateway processes", signal.Signals(signum).name,
                     sum(slot.process is not None for slot in self.slots))
            self.stopping = True
            grace = self.settings.shutdown_delay_s + self.settings.shutdown_grace_s
            self._kill_at = time.monotonic() + grace + STOP_MARGIN_S
            # The port closes once the children close their copies after the delay; held
            # open here, it would queue connections that nobody accepts.
            self._close_listeners()
        for slot in self.slots:
            if slot.process is not None and slot.process.exitcode is None and slot.process.pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(slot.process.pid, forward)

    def _close_listeners(self) -> None:
        for sock in self._socks:
            if sock is not None:
                sock.close()

    @property
    def _socket_per_slot(self) -> bool:
        return len(self._socks) > 1

    def _slot_socket(self, slot: _Slot) -> socket.socket | None:
        """The slot's listening socket, bound afresh if its last process's was closed (None:
        the bind failed, logged)."""
        if not self._socket_per_slot:
            return self._socks[0]
        sock = self._socks[slot.index]
        if sock is None:
            try:
                sock = self._socks[slot.index] = bind_listener(self._family, self._address, reuse_port=True)
            except OSError as e:
                log.error("slot %d: cannot listen on %s again: %s", slot.index, self._address, e)
        return sock

    def _close_slot_socket(self, slot: _Slot) -> None:
        """New connections go to the live processes while the slot is empty."""
        sock = self._socks[slot.index] if self._socket_per_slot else None
        if sock is not None:
            sock.close()
            self._socks[slot.index] = None

    def _on_exit(self, slot: _Slot) -> None:
        process = slot.process
        assert process is not None and process.pid is not None
        self._close_slot_socket(slot)  # first: until it is closed, new connections queue on it in vain
        process.join()
        _mark_process_dead(process.pid, self._metrics_dir)
        slot.process = None
        code = process.exitcode
        if self.stopping:
            log.info("gateway process %d exited (%s)", process.pid, _status(code))
            return
        if code == STARTUP_FAILURE:
            log.error("gateway process %d could not start: stopping (its log says why)", process.pid)
            self.exit_code = 1
            self._on_signal(signal.SIGTERM)
            return
        lived = time.monotonic() - slot.started_at
        slot.failures = 1 if lived >= STABLE_AFTER_S else slot.failures + 1
        log.warning("gateway process %d exited (%s) after %.1fs: replacing it in %.0fs",
                    process.pid, _status(code), lived, restart_delay_s(slot.failures))
        slot.restart_at = time.monotonic() + restart_delay_s(slot.failures)

    def _schedule_restart(self, slot: _Slot) -> None:
        slot.failures += 1
        slot.restart_at = time.monotonic() + max(1.0, restart_delay_s(slot.failures))

    def _kill_all(self) -> None:
        for slot in self.slots:
            if slot.process is not None and slot.process.exitcode is None:
                slot.process.kill()
        for slot in self.slots:
            if slot.process is not None:
                slot.process.join()
                _mark_process_dead(slot.process.pid or 0, self._metrics_dir)
                slot.process = None


def _status(code: int | None) -> str:
    if code is not None and code < 0:
        return signal.Signals(-code).name
    return f"exit status {code}"


@contextlib.contextmanager
def _metrics_directory() -> Iterator[str]:
    """A fresh private PROMETHEUS_MULTIPROC_DIR for the children (inherited at spawn)."""
    path = tempfile.mkdtemp(prefix="dgw-metrics-")  # mode 0700
    previous = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = path
    try:
        yield path
    finally:
        if previous is None:
            os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
        else:
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = previous
        shutil.rmtree(path, ignore_errors=True)


def _mark_process_dead(pid: int, path: str) -> None:
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(pid, path)


# ---------------------------------------------------------------------------- in the child


def child_main(settings: GatewaySettings, log_level: str, log_format: str, sock: socket.socket) -> None:
    """One supervised gateway process: the app on the shared socket until SIGTERM."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor forwards a Ctrl-C as SIGTERM
    from deepinfer_gateway.core import tracing
    from deepinfer_gateway.process.gateway_process import configure_logging, gateway_app, serve_gateway

    configure_logging(log_level, log_format)
    _drain_when_orphaned()
    tracing.configure(settings.tracing)
    try:
        try:
            app, shutting_down = gateway_app(settings)
        except Exception:
            log.exception("gateway process %d could not build its app", os.getpid())
            sys.exit(STARTUP_FAILURE)
        served = serve_gateway(app, shutting_down, settings, log_level, sock=sock,
                               headers=[(PROCESS_HEADER, str(os.getpid()))], signals=(signal.SIGTERM,),
                               skip_delay_signals=(SKIP_DELAY_SIGNAL,))
    finally:
        tracing.shutdown()
    # Straight out: the interpreter's teardown of the tokenizer's tables takes seconds (a
    # drain or a restart would wait for it), and spans and logs are flushed by now.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if served else STARTUP_FAILURE)


def _drain_when_orphaned() -> None:
    """A child whose supervisor died (SIGKILL) drains and exits rather than serve unsupervised."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="supervisor-watch", daemon=True).start()
