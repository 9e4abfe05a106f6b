"""Shared fixtures. Real parts only: a real redis-server, real HTTP on loopback."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

from deepinfer_gateway.launch import free_port, wait_for_port

if TYPE_CHECKING:
    import openai

    from deepinfer_gateway.launch import Gateway, SimCluster


@pytest.fixture(autouse=True)
def _restore_root_logging() -> Iterator[None]:
    """Tests that call `cli.main` in-process get the process's logging set-up, a root handler on
    pytest's capture stream; once that stream closes, every later test's log line would print
    a logging error ("I/O operation on closed file")."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def _redis_binary(name: str) -> str:
    binary = shutil.which(name)
    if binary is None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{name} is not installed; CI must never skip Redis tests")
        pytest.skip(f"{name} is not installed")
    return binary


def redis_backend_url(request: pytest.FixtureRequest, backend: str) -> str:
    """The URL of a Redis backend parameter: "redis" (`redis_url`) or "redis-cluster" (`redis_cluster_url`)."""
    return str(request.getfixturevalue(backend.replace("-", "_") + "_url"))


class RedisServer:
    """A redis-server process of the test's own on a free port (killable, restartable)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [_redis_binary("redis-server"), "--port", str(self.port), "--bind", "127.0.0.1",
             "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_for_port(self.port)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """REDIS_URL when given, else a redis-server of our own for the whole session."""
    given = os.environ.get("REDIS_URL")
    if given:
        yield given
        return
    server = RedisServer()
    server.start()
    yield server.url
    server.stop()


@pytest.fixture(scope="session")
def redis_cluster_url() -> Iterator[str]:
    """REDIS_CLUSTER_URL when given, else a 3-master Redis Cluster of our own (no replicas):
    the URL names one node; the cluster client finds the others."""
    given = os.environ.get("REDIS_CLUSTER_URL")
    if given:
        yield given
        return
    server, cli = _redis_binary("redis-server"), _redis_binary("redis-cli")
    ports = [free_port() for _ in range(3)]
    with tempfile.TemporaryDirectory() as tmp:
        procs = [
            subprocess.Popen(  # bus port given: the default, port + 10000, may exceed 65535
                [server, "--port", str(p), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                 "--cluster-enabled", "yes", "--cluster-port", str(free_port()),
                 "--cluster-config-file", f"{tmp}/nodes-{p}.conf"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )
            for p in ports
        ]
        try:
            for p in ports:
                wait_for_port(p)
            subprocess.run([cli, "--cluster", "create", *(f"127.0.0.1:{p}" for p in ports),
                            "--cluster-replicas", "0", "--cluster-yes"], check=True, capture_output=True, timeout=30)
            deadline = time.monotonic() + 20
            while b"cluster_state:ok" not in subprocess.run([cli, "-p", str(ports[0]), "cluster", "info"],
                                                           capture_output=True).stdout:
                assert time.monotonic() < deadline, "the Redis Cluster did not reach state ok"
                time.sleep(0.1)
            yield f"redis://127.0.0.1:{ports[0]}/0"
        finally:
            for proc in procs:
                proc.kill()
                proc.wait()


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A private redis-server a test may kill and restart."""
    server = RedisServer()
    server.start()
    yield server
    server.stop()


DEMO_WORKERS = "unified:sm100,unified:sm100,unified:ascend950"


@pytest.fixture(scope="session")
def sim_cluster() -> Iterator["SimCluster"]:
    """The demo's unified cluster (2 sm100 + 1 ascend950) in one process, 20x faster than real time."""
    from deepinfer_gateway.launch import SimCluster

    cluster = SimCluster(DEMO_WORKERS, time_scale=20.0)
    yield cluster
    cluster.stop()


@pytest.fixture(scope="session")
def gateway(sim_cluster: "SimCluster", tmp_path_factory: pytest.TempPathFactory) -> Iterator["Gateway"]:
    from deepinfer_gateway.launch import Gateway

    roles = [spec.split(":") for spec in sim_cluster.specs]
    gw = Gateway(tmp_path_factory.mktemp("gw"), [(url, role, hw) for url, (role, hw) in zip(sim_cluster.urls, roles)])
    gw.wait_ready(len(roles))
    yield gw
    gw.stop()


@pytest.fixture
def openai_client(gateway: "Gateway") -> Iterator["openai.OpenAI"]:
    import openai

    with openai.OpenAI(base_url=gateway.url + "/v1", api_key="test", max_retries=0, timeout=60) as client:
        yield client
