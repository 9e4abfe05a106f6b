"""`/metrics` on a port of its own (the `metrics_port` setting), so the clients' port need not
show the gateway's internals (worker ids, pools, load) to every API caller.

A small threaded HTTP server beside the event loop: a scrape renders the registry in its
thread (prometheus-client's metrics are thread-safe), so it costs the request path nothing
but the GIL while it renders. The socket sets SO_REUSEPORT: every process of
`serve --processes` binds the same port, the kernel hands each scrape to one of them, and
that one answers for the whole host (metrics_host.py merges every process's files).
"""

from __future__ import annotations

import http.server
import threading

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import CollectorRegistry


class _Server(http.server.ThreadingHTTPServer):
    allow_reuse_port = True
    daemon_threads = True

    def __init__(self, address: tuple[str, int], registry: CollectorRegistry):
        self.registry = registry
        super().__init__(address, _MetricsHandler)


class _MetricsHandler(http.server.BaseHTTPRequestHandler):
    server: _Server

    def do_GET(self) -> None:
        if self.path.split("?", 1)[0] != "/metrics":
            self._answer(404, b"only /metrics here\n", "text/plain; charset=utf-8")
            return
        self._answer(200, generate_latest(self.server.registry), CONTENT_TYPE_LATEST)

    def _answer(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("content-type", content_type)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:  # scrapes are not access-logged
        pass


class MetricsListener:
    def __init__(self, host: str, port: int, registry: CollectorRegistry):
        self._server = _Server((host, port), registry)  # binds now: a taken port fails the start
        self._thread = threading.Thread(target=self._server.serve_forever, name="metrics-listener", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
