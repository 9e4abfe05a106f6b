"""Workers added through `POST /admin/workers` get the workers' token with every call, so
only addresses the allow-list admits may be added (real gateway, sim workers and a
recording listener, all on loopback): a listener elsewhere is refused with a 400 and never
called; a host `admin_worker_hosts` lists, and a configured worker's own address, are
added; each change and refusal is logged with the key's name, never the key."""

from __future__ import annotations

import hashlib
import http.server
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from harness.launch import Gateway, SimCluster, free_port

ADMIN_KEY = "admin-secret-allow"
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}
TOKEN = "workers-token"
LISTENER_HOST = "127.0.0.2"  # loopback, outside the allowed 127.0.0.1/32


class Recorder(http.server.ThreadingHTTPServer):
    """Any HTTP listener: counts the calls it gets and the tokens they carry."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []  # (path, authorization)
        super().__init__((LISTENER_HOST, free_port()), _RecordingHandler)

    @property
    def url(self) -> str:
        return f"http://{LISTENER_HOST}:{self.server_address[1]}"


class _RecordingHandler(http.server.BaseHTTPRequestHandler):
    def _record(self) -> None:
        assert isinstance(self.server, Recorder)
        self.server.calls.append((self.path, self.headers.get("authorization", "")))
        self.send_response(200)
        self.send_header("content-length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    do_GET = do_POST = _record

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[SimCluster, Gateway, Recorder, Path]]:
    tmp = tmp_path_factory.mktemp("allow")
    recorder = Recorder()
    threading.Thread(target=recorder.serve_forever, daemon=True).start()
    cluster = SimCluster("unified:sm100,unified:sm100", time_scale=20.0, env={"DGW_WORKER_TOKEN": TOKEN})
    digest = hashlib.sha256(ADMIN_KEY.encode()).hexdigest()
    log = tmp / "gateway.log"
    with log.open("wb") as stderr:
        gateway = Gateway(tmp, [(cluster.urls[0], "unified", "sm100")], env={"DGW_WORKER_TOKEN": TOKEN},
                          stderr=stderr, extra_toml=f'admin_worker_hosts = ["127.0.0.1/32"]\n'
                                                    f'[[api_keys]]\nname = "ops-admin"\nkey_sha256 = "{digest}"\n'
                                                    "admin = true\n")
    try:
        gateway.wait_ready(1)
        yield cluster, gateway, recorder, log
    finally:
        gateway.stop()
        cluster.stop()
        recorder.shutdown()
        recorder.server_close()


def _workers(gateway: Gateway) -> set[str]:
    reply = httpx.get(gateway.url + "/admin/workers", headers=ADMIN, timeout=10)
    assert reply.status_code == 200, reply.text
    return {w["id"] for w in reply.json()["workers"]}


def test_a_worker_outside_the_allow_list_is_refused_and_never_called(
        rig: tuple[SimCluster, Gateway, Recorder, Path]) -> None:
    _, gateway, recorder, log = rig
    for spec in ({"url": recorder.url}, {"url": recorder.url + "/", "id": "looks-fine", "role": "unified"},
                 {"url": recorder.url.replace("://", "://127.0.0.1@")}):  # the host is after the @
        reply = httpx.post(gateway.url + "/admin/workers", headers=ADMIN, json=spec, timeout=10)
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]["code"] == "worker_not_allowed"
    time.sleep(1.5)  # several health rounds (0.2 s): an added worker would have been probed by now
    assert recorder.calls == []
    assert not any(LISTENER_HOST in worker_id or worker_id == "looks-fine" for worker_id in _workers(gateway))
    text = log.read_text()
    assert "admin key ops-admin" in text and "refused" in text and ADMIN_KEY not in text


def test_a_listed_host_and_a_configured_address_are_added(rig: tuple[SimCluster, Gateway, Recorder, Path]) -> None:
    cluster, gateway, _, log = rig
    listed = httpx.post(gateway.url + "/admin/workers", headers=ADMIN, json={"url": cluster.urls[1]}, timeout=10)
    assert listed.status_code == 201, listed.text
    configured_id = cluster.urls[0].split("://", 1)[1]
    assert httpx.delete(gateway.url + f"/admin/workers/{configured_id}", headers=ADMIN, timeout=10).status_code == 200
    again = httpx.post(gateway.url + "/admin/workers", headers=ADMIN, json={"url": cluster.urls[0], "pool": "p2"},
                       timeout=10)
    assert again.status_code == 201, again.text
    assert {configured_id, listed.json()["id"]} <= _workers(gateway)
    text = log.read_text()
    assert f"admin key ops-admin ({hashlib.sha256(ADMIN_KEY.encode()).hexdigest()[:8]}): worker {configured_id} " \
           "removed" in text
    assert ADMIN_KEY not in text
