"""bench/chaos.py's cluster: the shipped compose topology's processes, each on its own host
(bench/_netns.py), started and killed as the faults need.

- `redis`: deploy/docker-compose.yml's redis-server command, its ${...} variables filled in
  (REDIS_PASSWORD: one generated here), plus what the official image adds to a command
  without a config file (`--protected-mode no`) and its volume (`--dir`, kept across
  restarts: a pod restarted on its persistent volume).
- `gw1`, `gw2`: `serve --config deploy/gateway/compose-unified.toml` with the environment
  compose gives the gateways; the service names in it (redis) resolve through each host's
  /etc/hosts. The workers reach them as `DGW_WORKERS` (static `[[workers]]`).
- workers: `worker --engine sim` as compose starts them (0.0.0.0:8100), unified, sm100.
Gateways and workers share a worker token file (`DGW_WORKER_TOKEN_FILE`).
"""

from __future__ import annotations

import json
import re
import secrets
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import IO, Any

import redis
import yaml
from _netns import Lab

from deepinfer_gateway.launch import CLI, Proc
from deepinfer_gateway.redis_process import redis_server_binary

REPO = Path(__file__).resolve().parents[1]
COMPOSE = REPO / "deploy" / "docker-compose.yml"
GATEWAY_TOML = REPO / "deploy" / "gateway" / "compose-unified.toml"
GATEWAY_PORT, WORKER_PORT, REDIS_PORT = 8000, 8100, 6379

_VAR = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?-([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")


def compose_expand(value: str, env: dict[str, str]) -> str:
    """docker compose's interpolation: $$, ${VAR}, ${VAR:-default}, ${VAR-default}, $VAR."""
    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1) or m.group(3)
        if env.get(name):
            return env[name]
        return m.group(2) or ""
    return _VAR.sub(sub, value)


def compose_services(compose: Path = COMPOSE) -> dict[str, Any]:
    services: dict[str, Any] = yaml.safe_load(compose.read_text())["services"]
    return services


def shipped_redis_args(env: dict[str, str], compose: Path = COMPOSE) -> list[str]:
    """The arguments after `redis-server` in the compose file's redis command."""
    command = compose_services(compose)["redis"]["command"]
    words = [compose_expand(str(w), env) for w in (command if isinstance(command, list) else command.split())]
    if not words or Path(words[0]).name != "redis-server":
        raise ValueError(f"{compose}: the redis command {command!r} does not start redis-server")
    return words[1:]


def shipped_gateway_env(env: dict[str, str], compose: Path = COMPOSE) -> dict[str, str]:
    environment = compose_services(compose)["gateway-1"].get("environment") or {}
    if isinstance(environment, list):
        environment = dict(item.split("=", 1) for item in environment)
    return {k: compose_expand(str(v), env) for k, v in environment.items()}


def wait_tcp(host: str, port: int, timeout: float = 30.0, proc: Proc | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.proc.poll() is not None:
            raise RuntimeError(f"{' '.join(proc.cmd[4:])} exited with {proc.proc.returncode}")
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"nothing listening on {host}:{port} after {timeout}s")


def http(method: str, url: str, token: str | None = None, body: Any = None, timeout: float = 10.0) -> tuple[int, Any]:
    """(status, parsed JSON body or text); status 0 when no connection was made or it broke."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        request.add_header("content-type", "application/json")
    if token:
        request.add_header("authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    except (urllib.error.URLError, OSError) as e:
        return 0, str(e)
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


class Cluster:
    def __init__(self, lab: Lab, workdir: Path, gateways: tuple[str, ...], workers: tuple[str, ...],
                 time_scale: float):
        self.lab = lab
        self.workdir = workdir
        self.gateways, self.workers = gateways, workers
        self.time_scale = time_scale
        self.procs: dict[str, Proc] = {}
        self.logs: dict[str, IO[bytes]] = {}
        self.redis_password = secrets.token_urlsafe(24)
        token_file = workdir / "worker-token"
        token_file.write_text(secrets.token_urlsafe(32) + "\n")
        token_file.chmod(0o600)
        self.worker_token = token_file.read_text().strip()
        self.compose_env = {"REDIS_PASSWORD": self.redis_password, "DGW_LOG_LEVEL": "warning"}
        self.token_env = {"DGW_WORKER_TOKEN_FILE": str(token_file)}
        self.redis_dir = workdir / "redis-data"
        self.redis_dir.mkdir(exist_ok=True)

    def ip(self, host: str) -> str:
        return self.lab.hosts[host].ip

    def url(self, host: str) -> str:
        return f"http://{self.ip(host)}:{GATEWAY_PORT if host in self.gateways else WORKER_PORT}"

    def _start(self, host: str, cmd: list[str], env: dict[str, str] | None = None) -> Proc:
        if host not in self.logs:
            self.logs[host] = open(self.workdir / f"{host}.log", "ab")  # closed in stop_all
        log = self.logs[host]
        log.write(f"--- {time.strftime('%H:%M:%S')} {' '.join(cmd)}\n".encode())
        log.flush()
        proc = Proc(self.lab.exec_prefix(host) + cmd, env=env, stdout=log, stderr=log)
        self.procs[host] = proc
        return proc

    def kill(self, host: str) -> None:
        """SIGKILL: a crash."""
        self.procs[host].kill()

    def redis_args(self) -> list[str]:
        return [redis_server_binary(), *shipped_redis_args(self.compose_env), "--protected-mode", "no",
                "--dir", str(self.redis_dir), "--logfile", str(self.workdir / "redis-server.log")]

    def redis_client(self, password: str | None = "") -> redis.Redis:
        """A client on the Redis host; password "" (default): the cluster's, None: none."""
        return redis.Redis(host=self.ip("redis"), port=REDIS_PORT, socket_timeout=2, socket_connect_timeout=2,
                           password=self.redis_password if password == "" else password)

    def start_redis(self, timeout: float = 30.0) -> None:
        self._start("redis", self.redis_args())
        deadline = time.monotonic() + timeout
        while True:
            try:
                with self.redis_client() as client:
                    if client.ping():
                        return
            except redis.ResponseError as exc:
                if "LOADING" not in str(exc):  # a wrong password: no use waiting
                    raise
            except redis.RedisError:
                pass
            if time.monotonic() > deadline or self.procs["redis"].proc.poll() is not None:
                raise RuntimeError(f"redis did not answer PING; see {self.workdir}/redis-server.log")
            time.sleep(0.05)

    def start_worker(self, host: str) -> None:
        self._start(host, CLI + ["worker", "--engine", "sim", "--role", "unified", "--hardware", "sm100",
                                 "--host", "0.0.0.0", "--port", str(WORKER_PORT), "--worker-id", host,
                                 "--time-scale", str(self.time_scale)], env=self.token_env)

    def start_gateway(self, host: str) -> None:
        workers = [{"id": w, "url": self.url(w), "role": "unified", "hardware": "sm100"} for w in self.workers]
        env = {**shipped_gateway_env(self.compose_env), **self.token_env, "DGW_WORKERS": json.dumps(workers)}
        self._start(host, CLI + ["serve", "--config", str(GATEWAY_TOML)], env=env)

    def wait_ready(self, host: str, healthy: int, timeout: float = 60.0) -> None:
        """Until the gateway's /ready counts `healthy` workers."""
        deadline = time.monotonic() + timeout
        wait_tcp(self.ip(host), GATEWAY_PORT, timeout, self.procs[host])
        while time.monotonic() < deadline:
            status, body = http("GET", self.url(host) + "/ready", timeout=2)
            if status == 200 and isinstance(body, dict) and body.get("healthy_workers", 0) >= healthy:
                return
            time.sleep(0.2)
        raise TimeoutError(f"{host} never saw {healthy} healthy workers")

    def stop_all(self) -> None:
        for proc in self.procs.values():
            proc.kill()
        for log in self.logs.values():
            log.close()
