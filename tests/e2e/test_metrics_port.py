"""`metrics_port` and `api_docs = false` (a real gateway and sim worker on loopback): the
clients' port answers /metrics, /openapi.json, /docs and /redoc with 404 and serves the API;
/metrics is on its own port, for the whole host with several processes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from harness.launch import Gateway, SimCluster, free_port

MODEL = "DeepSeek-V4.1-Flash"


@pytest.fixture(scope="module")
def cluster() -> Iterator[SimCluster]:
    cluster = SimCluster("unified:sm100", time_scale=20.0)
    yield cluster
    cluster.stop()


@pytest.mark.parametrize("processes", [1, 2])
def test_metrics_on_their_own_port_and_no_docs_on_the_clients(cluster: SimCluster, tmp_path: Path,
                                                              processes: int) -> None:
    port = free_port()
    gateway = Gateway(tmp_path, [(cluster.urls[0], "unified", "sm100")], processes=processes,
                      extra_toml=f"metrics_port = {port}\napi_docs = false\n")
    try:
        gateway.wait_ready(1)
        reply = httpx.post(gateway.url + "/v1/chat/completions", timeout=30, json={
            "model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hello"}]})
        assert reply.status_code == 200, reply.text
        for path in ("/metrics", "/openapi.json", "/docs", "/redoc"):
            hidden = httpx.get(gateway.url + path, timeout=10)
            assert hidden.status_code == 404, (path, hidden.text[:200])
            assert "dgw_" not in hidden.text and "openapi" not in hidden.text
        scraped = [httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10) for _ in range(2 * processes)]
        for scrape in scraped:  # whichever process answers, it speaks for the host
            assert scrape.status_code == 200 and "text/plain" in scrape.headers["content-type"]
            assert 'dgw_requests_total{model="DeepSeek-V4.1-Flash",protocol="chat",status="200"} 1.0' in scrape.text
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).status_code == 404
    finally:
        gateway.stop()
