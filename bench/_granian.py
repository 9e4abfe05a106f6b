"""The gateway app served by granian (a Rust HTTP server; its ASGI interface) instead of uvicorn,
for `bench/gateway_capacity.py --server granian`: the same settings file and the same app as
`serve` (process/gateway_process.py `gateway_app`), granian's defaults otherwise (one worker
process, one runtime thread, uvloop). A measurement, not a shipped way to serve: it has none of
`serve`'s drain, connection bounds or supervisor.

`app` is granian's `--factory` target; the settings file comes from BENCH_GATEWAY_CONFIG (not a
DGW_ variable: the settings loader would warn of one it does not know).
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from harness.launch import START_TIMEOUT_S, Proc, free_port, wait_for_healthy_workers, wait_for_port


def app() -> Any:
    from deepinfer_gateway.config import load_settings
    from deepinfer_gateway.process.gateway_process import gateway_app

    return gateway_app(load_settings(os.environ["BENCH_GATEWAY_CONFIG"]))[0]


class GranianGateway:
    """What bench/gateway_capacity.py reads of a harness `Gateway`: `proc`, `url`, `wait_ready`, `stop`."""

    def __init__(self, worker_url: str, extra_toml: str = "", env: dict[str, str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = Path(tempfile.mkdtemp()) / "gateway.toml"
        config.write_text("\n".join([extra_toml, "[health]", "interval_s = 0.2", "", "[[workers]]",
                                     f'url = "{worker_url}"', 'role = "unified"', 'hardware = "sm100"', ""]))
        self.proc = Proc([sys.executable, "-m", "granian", "--interface", "asgi", "--factory", "--host", "127.0.0.1",
                          "--port", str(self.port), "--loop", "uvloop", "--no-ws", "--log-level", "warning",
                          "--working-dir", str(Path(__file__).parent), "_granian:app"],
                         env={**(env or {}), "BENCH_GATEWAY_CONFIG": str(config)})
        try:
            wait_for_port(self.port, START_TIMEOUT_S, self.proc)
        except BaseException:
            self.proc.kill()
            raise

    def wait_ready(self, healthy: int, timeout: float = 15.0) -> None:
        wait_for_healthy_workers(self.url, healthy, timeout)

    def stop(self) -> None:
        self.proc.stop()
