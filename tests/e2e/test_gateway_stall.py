"""A gateway process that stops for longer than its worker timeouts (SIGSTOP: what a starved
CPU or a long synchronous step does to its event loop) must not eject the healthy workers:
on resume, uvloop fires the expired connect and health-check timeouts before it reads the
connections that completed meanwhile. Those timeouts are the gateway's own stall
(gateway/telemetry/loop_lag.py), counted in dgw_stall_timeouts_total, not worker failures."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
import urllib.request
from pathlib import Path

import openai

from harness.launch import Gateway, SimCluster


def _metric(url: str, name: str) -> list[float]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name)]


def test_a_stopped_gateway_resumes_without_ejecting_live_workers(sim_cluster: SimCluster, tmp_path: Path) -> None:
    roles = [spec.split(":") for spec in sim_cluster.specs]
    # A listener that never answers: the gateway always has a health check waiting on it, so the
    # stop below always lands on a call in flight whose timeout then fires on resume.
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)
    workers = [(url, role, hw) for url, (role, hw) in zip(sim_cluster.urls, roles, strict=True)]
    log = (tmp_path / "gateway.log").open("wb")
    gw = Gateway(tmp_path, [*workers, (f"http://127.0.0.1:{silent.getsockname()[1]}", "unified", "sm100")],
                 health_interval_s=0.1, stderr=log)
    try:
        gw.wait_ready(len(roles))
        results: list[str] = []

        def traffic(i: int) -> None:
            with openai.OpenAI(base_url=gw.url + "/v1", api_key="t", max_retries=0, timeout=60) as client:
                for j in range(6):
                    try:
                        client.chat.completions.create(model="DeepSeek-V4.1-Flash", max_tokens=8,
                                                       messages=[{"role": "user", "content": f"stall {i} {j}"}])
                        results.append("ok")
                    except openai.APIError as exc:
                        results.append(type(exc).__name__)
                    time.sleep(0.05)

        threads = [threading.Thread(target=traffic, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        time.sleep(0.3)
        os.kill(gw.proc.proc.pid, signal.SIGSTOP)  # past connect_timeout_s (2 s) and the health timeout
        time.sleep(3.0)
        os.kill(gw.proc.proc.pid, signal.SIGCONT)
        for t in threads:
            t.join(timeout=60)
        assert results.count("ok") == 36, results
        healthy = _metric(gw.url, "dgw_worker_healthy{")
        assert sorted(healthy) == [0.0] + [1.0] * len(roles)  # the silent one never was
        assert "ejected" not in (tmp_path / "gateway.log").read_text()  # the live ones not even for a moment
        assert sum(_metric(gw.url, "dgw_stall_timeouts_total")) >= 1  # the stall was seen and set aside
        assert _metric(gw.url, "dgw_event_loop_lag_seconds_count") and max(
            _metric(gw.url, 'dgw_event_loop_lag_seconds_bucket{le="+Inf"}')) > 0
    finally:
        os.kill(gw.proc.proc.pid, signal.SIGCONT)
        gw.stop()
        log.close()
        silent.close()
