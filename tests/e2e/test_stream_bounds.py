"""A streaming client that stops reading is cut off after `write_timeout_s` and its request is
released (in flight back to zero, the worker's request aborted)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.launch import Gateway, SimCluster
from tests.e2e.test_faults_clients import ClusterLoads, body, raw_stream_request, wait_metric
from tests.fault_doubles import scrape, total

pytestmark = pytest.mark.e2e

WRITE_TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def cluster() -> Iterator[SimCluster]:
    c = SimCluster("unified:sm100", time_scale=5.0)
    yield c
    c.stop()


@pytest.mark.parametrize("protocol", ["v1", "auto"])
def test_a_client_that_stops_reading_is_cut_off_and_its_request_released(cluster: SimCluster, tmp_path: Path,
                                                                         protocol: str) -> None:
    toml = f'worker_protocol = "{protocol}"\n[client_connections]\nwrite_timeout_s = {WRITE_TIMEOUT_S}\n'
    gw = Gateway(tmp_path, [(cluster.urls[0], "unified", "sm100")], extra_toml=toml)
    try:
        gw.wait_ready(1)
        started = time.monotonic()
        # Far more tokens than the sockets' buffers hold, and far longer than this test waits.
        sock = raw_stream_request(gw.port, body(1, 60_000, ignore_eos=True), rcvbuf=1024)
        try:
            assert sock.recv(256).startswith(b"HTTP/1.1 200 ")  # the stream started; never read again
            assert wait_metric(gw, "dgw_inflight_requests", 1, timeout=20) == 1
            assert wait_metric(gw, "dgw_inflight_requests", 0, timeout=60) == 0
            released_after = time.monotonic() - started
            loads = ClusterLoads(cluster).wait_idle(timeout=10)
            assert loads[0]["running"] == 0 and loads[0]["waiting"] == 0  # aborted on the worker
            # The client's connection is gone: what the buffers held, then the end.
            sock.settimeout(10)
            received = b""
            try:
                while chunk := sock.recv(65536):
                    received += chunk
            except ConnectionResetError:
                pass
            assert b"[DONE]" not in received
        finally:
            sock.close()
        m = scrape(gw.url)
        assert total(m, "dgw_requests_total", status="499") == 1
        assert total(m, "dgw_client_disconnects_total") == 1
        assert released_after < 60
    finally:
        gw.stop()
