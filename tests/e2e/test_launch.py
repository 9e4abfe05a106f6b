"""launch.py's start-up wait: a started process that exits before it listens fails the wait at
once, with its exit code, instead of after the (long) start-up bound."""

from __future__ import annotations

import socket
import sys
import time

import pytest

from harness import launch
from harness.launch import START_TIMEOUT_S, Proc, SimCluster, free_port, wait_for_port


def test_a_process_that_exits_before_listening_ends_the_wait_at_once() -> None:
    proc = Proc([sys.executable, "-c", "raise SystemExit(3)"])
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="exited 3 before listening"):
        wait_for_port(free_port(), START_TIMEOUT_S, proc)
    assert time.monotonic() - started < START_TIMEOUT_S / 3


def test_a_listening_process_ends_the_wait() -> None:
    port = free_port()
    server = Proc([sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(port)])
    try:
        wait_for_port(port, START_TIMEOUT_S, server)
        assert server.proc.poll() is None
    finally:
        server.stop()


def test_a_sim_cluster_whose_ports_were_taken_starts_on_another_block(monkeypatch: pytest.MonkeyPatch) -> None:
    # The block probed free is taken before the cluster binds it (here: bound, not listening, by this test).
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken_port = taken.getsockname()[1]
        blocks = iter([taken_port])
        real_block = launch._free_port_block
        monkeypatch.setattr(launch, "_free_port_block", lambda n: next(blocks, None) or real_block(n))
        cluster = SimCluster("unified:sm100")
        try:
            assert cluster.base_port != taken_port
            wait_for_port(cluster.base_port, 5)
        finally:
            cluster.stop()
