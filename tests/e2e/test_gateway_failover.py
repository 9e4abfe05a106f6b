"""Faults on the request path: dead workers before the request, and the gateway staying up."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import openai
import pytest

from harness.launch import CLI, Gateway, Proc, free_port, wait_for_port

MODEL = "DeepSeek-V4.1-Flash"


@pytest.fixture
def two_workers() -> list[tuple[Proc, str]]:  # type: ignore[misc]
    workers = []
    for hardware in ("sm100", "ascend950"):
        port = free_port()
        proc = Proc(CLI + ["worker", "--engine", "sim", "--hardware", hardware, "--port", str(port),
                           "--time-scale", "20"])
        workers.append((proc, f"http://127.0.0.1:{port}"))
    for _, url in workers:
        wait_for_port(int(url.rsplit(":", 1)[1]), timeout=30)
    yield workers
    for proc, _ in workers:
        proc.kill()


def test_dead_worker_is_retried_then_503_when_none_left(tmp_path: Path, two_workers) -> None:
    (dead, _), (alive, _) = two_workers
    gw = Gateway(tmp_path, [(url, "unified", "sm100") for _, url in two_workers])
    try:
        gw.wait_ready(2)
        dead.kill()  # killed before the requests; the health check has not noticed yet
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
        for i in range(4):  # round robin sends some of these to the dead worker first
            out = client.chat.completions.create(model=MODEL, max_tokens=4,
                                                 messages=[{"role": "user", "content": f"q{i}"}])
            assert out.choices[0].message.content is not None
        metrics = httpx.get(gw.url + "/metrics").text
        assert "dgw_upstream_errors_total" in metrics
        alive.kill()
        r = httpx.post(gw.url + "/v1/chat/completions",
                       json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code in (502, 503)
        assert r.json()["error"]["message"]
        assert httpx.get(gw.url + "/health").status_code == 200  # the gateway stays up
        assert httpx.get(gw.url + "/ready").status_code == 503
    finally:
        gw.stop()


def test_worker_is_ejected_and_readmitted_after_restart(tmp_path: Path) -> None:
    port = free_port()
    cmd = CLI + ["worker", "--engine", "sim", "--port", str(port), "--time-scale", "20"]
    worker = Proc(cmd)
    wait_for_port(port, timeout=30)
    gw = Gateway(tmp_path, [(f"http://127.0.0.1:{port}", "unified", "sm100")])
    try:
        gw.wait_ready(1)
        worker.kill()
        deadline = time.monotonic() + 5
        while httpx.get(gw.url + "/ready").status_code != 503:  # active health checks eject it
            assert time.monotonic() < deadline, "dead worker never ejected"
            time.sleep(0.05)
        assert f'dgw_worker_healthy{{worker="127.0.0.1:{port}"}} 0.0' in httpx.get(gw.url + "/metrics").text
        worker = Proc(cmd)  # back on the same address, with a new epoch
        wait_for_port(port, timeout=30)
        gw.wait_ready(1)
        r = httpx.post(gw.url + "/v1/chat/completions", timeout=30,
                       json={"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "back?"}]})
        assert r.status_code == 200
    finally:
        gw.stop()
        worker.kill()
