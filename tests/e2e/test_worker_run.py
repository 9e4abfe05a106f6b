"""The single-worker entry point serves the protocol and stops cleanly on SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

from harness.launch import free_port, wait_for_port

ROOT = Path(__file__).resolve().parents[2]


def test_run_worker_serves_and_stops_on_sigterm() -> None:
    port = free_port()
    code = (
        "from deepinfer_gateway.core.protocol import Role\n"
        "from deepinfer_gateway.workers.sim.run import WorkerOptions, run_worker\n"
        f"run_worker(WorkerOptions(role=Role.PREFILL, hardware='ascend950', port={port}, time_scale=1000.0))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env)
    try:
        wait_for_port(port, timeout=30)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/worker/info", timeout=5) as resp:
            info = json.load(resp)
        assert (info["role"], info["hardware"], info["engine"]) == ("prefill", "ascend950", "sim")
        assert info["worker_id"] == f"ascend950-prefill-{port}"
    finally:
        proc.send_signal(signal.SIGTERM)
        # uvicorn shuts down gracefully, then re-raises the signal it captured.
        assert proc.wait(timeout=15) in (0, -signal.SIGTERM)
