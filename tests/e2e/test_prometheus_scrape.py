"""A real Prometheus scraping a real gateway: a worker's first upstream error shows in
`increase()` over a window, because its counter was scraped at 0 before the error (a series
born at 1 shows no increase). Prometheus is Debian's `prometheus` server binary, on a free
loopback port with its own config and storage; under CI=true it never skips."""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from harness.launch import CLI, Gateway, Proc, free_port, wait_for_port

MODEL = "DeepSeek-V4.1-Flash"


def prometheus_binary() -> str:
    path = shutil.which("prometheus")
    if path is None:
        if os.environ.get("CI") == "true":
            pytest.fail("prometheus server missing (system-packages.txt: prometheus); CI must never skip it")
        pytest.skip("prometheus server missing (system-packages.txt: prometheus)")
    return path


class Prometheus:
    def __init__(self, tmp: Path, target: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = tmp / "prometheus.yml"
        config.write_text(
            "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
            "scrape_configs:\n"
            "  - job_name: dgw-gateway\n"
            f"    static_configs: [{{targets: ['{target}']}}]\n")
        self.log = (tmp / "prometheus.log").open("wb")
        self.proc = Proc([prometheus_binary(), f"--config.file={config}", f"--storage.tsdb.path={tmp / 'tsdb'}",
                          f"--web.listen-address=127.0.0.1:{self.port}"], stdout=self.log, stderr=self.log)
        try:
            wait_for_port(self.port, timeout=30)
            self._wait_ready(30.0)  # the port opens before the TSDB is loaded: queries answer 503 until then
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while httpx.get(self.url + "/-/ready", timeout=5).status_code != 200:
            assert time.monotonic() < deadline, "Prometheus never became ready"
            time.sleep(0.1)

    def query(self, promql: str) -> list[dict[str, Any]]:
        r = httpx.get(self.url + "/api/v1/query", params={"query": promql}, timeout=10)
        r.raise_for_status()
        body = r.json()
        assert body["status"] == "success", body
        return body["data"]["result"]

    def wait_for(self, promql: str, timeout: float = 30.0) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if result := self.query(promql):
                return result
            time.sleep(0.25)
        raise AssertionError(f"no result for {promql} within {timeout} s")

    def stop(self) -> None:
        self.proc.stop()
        self.log.close()


@pytest.fixture
def workers() -> Iterator[list[tuple[Proc, str]]]:
    started = []
    for _ in range(2):
        port = free_port()
        proc = Proc(CLI + ["worker", "--engine", "sim", "--hardware", "sm100", "--port", str(port),
                           "--time-scale", "20"])
        started.append((proc, f"http://127.0.0.1:{port}"))
    for _, url in started:
        wait_for_port(int(url.rsplit(":", 1)[1]), timeout=30)
    yield started
    for proc, _ in started:
        proc.kill()


def test_increase_sees_a_workers_first_upstream_error(tmp_path: Path, workers: list[tuple[Proc, str]]) -> None:
    # Health checks every 60 s: only a live request finds the dead worker, so the error is the
    # request path's (the registry's count_error), not a health check's. Round robin: the
    # next request or so goes to the dead worker (a cache-aware policy could keep away from it).
    gw = Gateway(tmp_path, [(url, "unified", "sm100") for _, url in workers], health_interval_s=60,
                 extra_toml='[router]\npolicy = "round_robin"')
    try:
        prom = Prometheus(tmp_path, f"127.0.0.1:{gw.port}")
    except BaseException:
        gw.stop()
        raise
    stop = threading.Event()
    answers: list[int] = []

    def load() -> None:  # a bounded closed loop: one request at a time until told to stop
        with httpx.Client(base_url=gw.url, timeout=30) as client:
            for i in range(2000):
                if stop.is_set():
                    return
                r = client.post("/v1/chat/completions", json={
                    "model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": f"question {i}"}]})
                answers.append(r.status_code)

    loader = threading.Thread(target=load)
    try:
        gw.wait_ready(2)
        ready = prom.wait_for('up{job="dgw-gateway"} == 1')
        assert ready
        # Before any error: every worker's connect-error series is scraped, at 0.
        before = prom.wait_for('count(dgw_upstream_errors_total{kind="connect"}) == 2')
        assert before
        zeros = prom.query('dgw_upstream_errors_total{kind="connect"}')
        assert sorted(float(s["value"][1]) for s in zeros) == [0.0, 0.0]
        # Two scrapes at 0: increase() is defined, and 0.
        assert prom.wait_for('sum(increase(dgw_upstream_errors_total[30s])) == 0')

        loader.start()
        deadline = time.monotonic() + 30
        while len(answers) < 5:
            assert time.monotonic() < deadline, "load never got going"
            time.sleep(0.05)
        dead, _ = workers[0]
        dead.kill()  # mid-load: round robin sends the next request or so to the dead worker

        seen = prom.wait_for('sum by (worker) (increase(dgw_upstream_errors_total{kind="connect"}[30s])) > 0')
        stop.set()
        loader.join(timeout=60)
        assert len(seen) == 1 and float(seen[0]["value"][1]) > 0
        dead_id = seen[0]["metric"]["worker"]
        raw = prom.query(f'dgw_upstream_errors_total{{kind="connect", worker="{dead_id}"}}')
        assert float(raw[0]["value"][1]) >= 1  # the raw counter: its first errors
        assert prom.wait_for('sum(increase(dgw_retries_total{reason="connect"}[30s])) > 0')
        # The load carried on: every request was answered (retried on the live worker).
        assert answers and set(answers) == {200}, sorted(set(answers))
    finally:
        stop.set()
        if loader.is_alive():
            loader.join(timeout=60)
        prom.stop()
        gw.stop()
