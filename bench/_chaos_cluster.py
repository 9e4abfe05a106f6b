"""bench/chaos.py's cluster: the shipped compose topology's processes, each on its own host
(bench/_netns.py), started and killed as the faults need, each run as deploy/docker-compose.yml
(with the docker-compose.unified.yml override) runs it:

- Compose's interpolation (${VAR:-default}, $$), then each container path of a service's
  volumes mapped to a host path: a bind mount (`./k8s/redis.conf`) to the file under
  deploy/, a named volume (`redis-data`, `dgw-secrets`) to a directory of the run's own,
  kept across restarts (a pod restarted on its volume).
- `secrets`: its own script, which writes the Redis password and the worker token.
- `redis`: its command through `sh -c`, with the redis-server binary found here in place of
  the image's `docker-entrypoint.sh redis-server` (and what that entrypoint adds to a
  config file that does not set it: `--protected-mode no`), in its data volume as the
  image's working directory.
- `dns`: dnsmasq answering the worker pool's name (WORKERS_NAME) with the live workers'
  addresses; the gateways' hosts have it as their resolver (/etc/netns/<host>/resolv.conf).
- `gw1`, `gw2`: `serve --config deploy/gateway/compose-unified.toml` with compose's gateway
  environment; service names in it (redis) resolve through each host's /etc/hosts. The
  workers are found by DNS: the config's static `[[workers]]` replaced by one
  `[[discovery]]` of WORKERS_NAME (`DGW_WORKERS`, `DGW_DISCOVERY`).
- workers: `worker --engine sim` as the unified override starts them (0.0.0.0:8100),
  unified, sm100, with compose's worker environment (the token file).
"""

from __future__ import annotations

import json
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import IO, Any

import redis
import yaml

sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # harness/, at the repository root
from _netns import Lab

from deepinfer_gateway.infra.redis_process import redis_server_binary
from harness.dnsmasq import dnsmasq_binary
from harness.launch import CLI, Proc

REPO = Path(__file__).resolve().parents[1]
COMPOSE = REPO / "deploy" / "docker-compose.yml"
GATEWAY_TOML = REPO / "deploy" / "gateway" / "compose-unified.toml"
GATEWAY_SERVICE, WORKER_SERVICE = "gateway-1", "prefill-sm100-1"
GATEWAY_PORT, WORKER_PORT, REDIS_PORT = 8000, 8100, 6379
WORKERS_NAME = "workers.dgw.test"  # the DNS name of the worker pool (a headless Service, a compose service)
DISCOVERY_INTERVAL_S = 2.0

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


class ComposeFile:
    """The services of a compose file, their commands and environments with container paths
    turned into host paths (named volumes under `volumes_dir`)."""

    def __init__(self, volumes_dir: Path, env: dict[str, str], path: Path = COMPOSE):
        self.path = path
        self.services: dict[str, Any] = yaml.safe_load(path.read_text())["services"]
        self.volumes_dir = volumes_dir
        self.env = env

    def mounts(self, service: str) -> list[tuple[str, Path]]:
        """(container path, host path) of the service's volumes, the longest container path first."""
        out = []
        for volume in self.services[service].get("volumes") or []:
            source, target = str(volume).split(":")[:2]
            if source.startswith((".", "/")):
                host = (self.path.parent / source).resolve()
            else:
                host = self.volumes_dir / source
                host.mkdir(parents=True, exist_ok=True)
            out.append((target, host))
        return sorted(out, key=lambda m: -len(m[0]))

    def on_host(self, service: str, text: str) -> str:
        for target, host in self.mounts(service):
            text = re.sub(rf"{re.escape(target)}(?=[/\s\"':]|$)", str(host), text)
        return text

    def environment(self, service: str) -> dict[str, str]:
        environment = self.services[service].get("environment") or {}
        if isinstance(environment, list):
            environment = dict(str(item).split("=", 1) for item in environment)
        return {k: self.on_host(service, compose_expand(str(v), self.env)) for k, v in environment.items()}

    def script(self, service: str) -> str:
        """The service's entrypoint + command as one shell script, container paths on the host."""
        service_def = self.services[service]
        words = [compose_expand(str(w), self.env) for w in (service_def.get("entrypoint") or [])]
        command = service_def.get("command") or []
        words += [compose_expand(str(w), self.env) for w in (command if isinstance(command, list) else [command])]
        if words[:2] == ["sh", "-c"] and len(words) == 3:
            text = words[2]
        else:
            text = shlex.join(words)
        return self.on_host(service, text)

    def host_path(self, service: str, container_path: str) -> Path:
        return Path(self.on_host(service, container_path))


def redis_script(compose: ComposeFile, binary: str, data_dir: Path, logfile: Path) -> str:
    """The shipped redis command, run here: the binary for the image's entrypoint, in its data
    volume; its options last, so they cannot be overridden by the shipped ones."""
    script = compose.script("redis")
    swapped = re.sub(r"(docker-entrypoint\.sh\s+)?\bredis-server\b", shlex.quote(binary), script, count=1)
    if swapped == script:
        raise ValueError(f"{compose.path}: the redis command does not start redis-server: {script!r}")
    return f"cd {shlex.quote(str(data_dir))} && {swapped} --protected-mode no --logfile {shlex.quote(str(logfile))}"


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
        self.compose = ComposeFile(workdir / "volumes", {"DGW_LOG_LEVEL": "warning"})
        done = subprocess.run(["sh", "-c", self.compose.script("secrets")], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"the compose secrets script failed: {done.stderr}")
        self.redis_password = self._secret("DGW_REDIS__PASSWORD_FILE", GATEWAY_SERVICE)
        # The shipped Redis has no default user: the bench adds keys and reads state as its admin,
        # whose password the compose secrets script writes beside the gateway's.
        gateway_password = self.compose.environment(GATEWAY_SERVICE).get("DGW_REDIS__PASSWORD_FILE")
        admin_file = Path(gateway_password).parent / "redis-admin-password" if gateway_password else None
        self.redis_admin_password = admin_file.read_text().strip() if admin_file and admin_file.exists() else ""
        self.worker_token = self._secret("DGW_WORKER_TOKEN_FILE", WORKER_SERVICE)
        self.redis_dir = next((host for target, host in self.compose.mounts("redis") if target == "/data"),
                              workdir / "volumes" / "redis-data")
        self.redis_dir.mkdir(parents=True, exist_ok=True)

    def _secret(self, variable: str, service: str) -> str:
        """The secret a service's environment names by file, "" when it names none."""
        path = self.compose.environment(service).get(variable)
        return Path(path).read_text().strip() if path else ""

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

    def redis_cmd(self) -> list[str]:
        return ["sh", "-c", redis_script(self.compose, redis_server_binary(), self.redis_dir,
                                         self.workdir / "redis-server.log")]

    def redis_client(self, password: str | None = "") -> redis.Redis:
        """A client on the Redis host; password "" (default): as the shipped admin user (the
        default user where the compose file ships no admin), None: no user and no password."""
        if password is None:
            return redis.Redis(host=self.ip("redis"), port=REDIS_PORT, socket_timeout=2, socket_connect_timeout=2)
        admin = self.redis_admin_password
        return redis.Redis(host=self.ip("redis"), port=REDIS_PORT, socket_timeout=2, socket_connect_timeout=2,
                           username="admin" if admin else None,
                           password=password or admin or self.redis_password or None)

    def start_redis(self, timeout: float = 30.0) -> None:
        self._start("redis", self.redis_cmd())
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
                                 "--time-scale", str(self.time_scale)], env=self.compose.environment(WORKER_SERVICE))

    def start_dns(self, workers: list[str]) -> None:
        """dnsmasq on the dns host, port 53, answering WORKERS_NAME from a hosts file it re-reads
        on SIGHUP (the flags of deepinfer_gateway/dnsmasq.py); the gateways' hosts use it as
        their resolver, as containers use compose's DNS."""
        self.dns_hosts = self.workdir / "dns.hosts"
        self.set_dns(workers, signal_server=False)
        self._start("dns", [dnsmasq_binary(), "--no-daemon", "--no-resolv", "--no-hosts", "--bind-interfaces",
                            f"--listen-address={self.ip('dns')}", "--port=53", f"--addn-hosts={self.dns_hosts}",
                            f"--local=/{WORKERS_NAME.split('.', 1)[1]}/", "--local-ttl=0", "--cache-size=0"])
        wait_tcp(self.ip("dns"), 53, 30, self.procs["dns"])
        for host in self.gateways:
            self.lab.write_etc(host, "resolv.conf", f"nameserver {self.ip('dns')}\n")

    def set_dns(self, workers: list[str], signal_server: bool = True) -> None:
        """WORKERS_NAME answers exactly these workers' addresses from now on."""
        tmp = self.dns_hosts.with_suffix(".tmp")
        tmp.write_text("".join(f"{self.ip(w)} {WORKERS_NAME}\n" for w in workers))
        tmp.replace(self.dns_hosts)
        if signal_server:
            self.procs["dns"].proc.send_signal(signal.SIGHUP)

    def start_gateway(self, host: str) -> None:
        """Workers found by DNS: the shipped config's static [[workers]] replaced by one [[discovery]]."""
        discovery = [{"name": WORKERS_NAME, "port": WORKER_PORT, "interval_s": DISCOVERY_INTERVAL_S}]
        env = {**self.compose.environment(GATEWAY_SERVICE), "DGW_WORKERS": "[]", "DGW_DISCOVERY": json.dumps(discovery)}
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
