"""A gateway without API keys serves anyone: beyond loopback it refuses to start unless the
settings allow an open endpoint; the demo beyond loopback (the image's default) is keyed."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

import httpx
import pytest

from harness.launch import CLI, START_TIMEOUT_S, Proc, free_port, wait_for_port

pytestmark = pytest.mark.e2e

KEYLESS_ENV = {k: v for k, v in os.environ.items() if not k.startswith("DGW_")}


def test_a_keyless_gateway_beyond_loopback_refuses_to_start() -> None:
    done = subprocess.run([sys.executable, "-m", "deepinfer_gateway", "serve", "--host", "0.0.0.0",
                           "--port", str(free_port())], env=KEYLESS_ENV, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "allow_unauthenticated" in done.stderr and "api_keys" in done.stderr


def test_allow_unauthenticated_serves_an_open_endpoint_on_purpose() -> None:
    port = free_port()
    proc = Proc(CLI + ["serve", "--host", "0.0.0.0", "--port", str(port), "--allow-unauthenticated"],
                env={"DGW_WORKERS": "[]"})
    try:
        wait_for_port(port, START_TIMEOUT_S, proc)
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10)
        assert models.status_code == 200 and models.json()["data"]
    finally:
        proc.stop()


def test_the_demo_beyond_loopback_is_keyed_with_the_key_it_prints() -> None:
    port = free_port()
    with tempfile.TemporaryFile() as out:
        proc = Proc(CLI + ["demo", "--host", "0.0.0.0", "--port", str(port), "--topology", "unified",
                           "--processes", "1", "--worker-base-port", str(free_port()), "--time-scale", "20"],
                    stdout=out)
        try:
            wait_for_port(port, START_TIMEOUT_S, proc)
            out.seek(0)
            printed = re.search(rb'api_key="([^"]+)"', out.read())
            assert printed is not None
            key = printed.group(1).decode()
            assert key != "demo"
            url = f"http://127.0.0.1:{port}/v1/models"
            assert httpx.get(url, timeout=10).status_code == 401
            assert httpx.get(url, headers={"authorization": "Bearer wrong"}, timeout=10).status_code == 401
            assert httpx.get(url, headers={"authorization": f"Bearer {key}"}, timeout=10).status_code == 200
        finally:
            proc.stop()
