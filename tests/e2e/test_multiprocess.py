"""`serve --processes 2` for real: a supervisor, two gateway processes on one port, the Redis
they start for themselves on a Unix socket, a simulated cluster, the OpenAI SDK as client.

Which process serves a request is read from its `x-dgw-process` header (the pid). An
HTTP client keeps its connection, so a client whose first request went to process P sends
every later one to P: `pinned_clients` holds one such client per process, which lets a
test put each turn, request or stream on the process it wants."""

from __future__ import annotations

import hashlib
import os
import signal
import socket
import stat
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import redis

from deepinfer_gateway.process.supervisor import PROCESS_HEADER
from harness.launch import Gateway, SimCluster

MODEL = "DeepSeek-V4.1-Flash"
KEY, LIMITED_KEY = "mp-test-key", "mp-limited-key"
LIMIT_RPM = 5
KEYS_TOML = f"""
[[api_keys]]
name = "open"
key_sha256 = "{hashlib.sha256(KEY.encode()).hexdigest()}"

[[api_keys]]
name = "limited"
key_sha256 = "{hashlib.sha256(LIMITED_KEY.encode()).hexdigest()}"
requests_per_minute = {LIMIT_RPM}
"""


@pytest.fixture(scope="module")
def cluster() -> Iterator[SimCluster]:
    # Real time (scale 1) so a stream of a few hundred tokens lasts seconds; no shared store
    # tier, so a cached prompt means the route found the worker that holds it.
    c = SimCluster("unified:sm100,unified:sm100,unified:sm100", time_scale=1.0, extra=["--no-store"])
    yield c
    c.stop()


def start_gateway(tmp: Path, cluster: SimCluster, extra_toml: str = "") -> Gateway:
    gateway = Gateway(tmp, [(url, "unified", "sm100") for url in cluster.urls], extra_toml=extra_toml, processes=2)
    gateway.wait_ready(len(cluster.urls), timeout=60)
    return gateway


@pytest.fixture(scope="module")
def gateway(cluster: SimCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    g = start_gateway(tmp_path_factory.mktemp("mp"), cluster, KEYS_TOML)
    yield g
    g.stop()


def new_client(gateway: Gateway, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0, timeout=30)


def served_by(client: openai.OpenAI) -> int:
    return int(client.models.with_raw_response.list().headers[PROCESS_HEADER])


def pinned_clients(gateway: Gateway, processes: int = 2, key: str = KEY,
                   timeout: float = 60) -> dict[int, openai.OpenAI]:
    """One client per gateway process, each on a kept-alive connection to it."""
    found: dict[int, openai.OpenAI] = {}
    deadline = time.monotonic() + timeout
    while len(found) < processes:
        assert time.monotonic() < deadline, f"only processes {sorted(found)} answered"
        batch = [new_client(gateway, key) for _ in range(4)]  # concurrent: each process takes some
        with ThreadPoolExecutor(len(batch)) as pool:
            pids = list(pool.map(served_by, batch))
        for pid, client in zip(pids, batch, strict=True):
            if pid in found:
                client.close()
            else:
                found[pid] = client
    return found


def chat(client: openai.OpenAI, messages: list[dict[str, str]], **kwargs: object) -> tuple[int, object]:
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages,
                                                           max_tokens=8, **kwargs)
    return int(raw.headers[PROCESS_HEADER]), raw.parse()


def supervised_pids(supervisor: int) -> set[int]:
    out: set[int] = set()
    for task in Path(f"/proc/{supervisor}/task").iterdir():
        out.update(int(pid) for pid in (task / "children").read_text().split())
    return out


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text()


def test_two_processes_answer_on_one_port(gateway: Gateway) -> None:
    clients = pinned_clients(gateway)
    assert len(clients) == 2
    assert set(clients) <= supervised_pids(gateway.proc.proc.pid)
    for pid, client in clients.items():
        for _ in range(3):  # a kept-alive connection stays with its process
            served, completion = chat(client, [{"role": "user", "content": "Hello"}])
            assert served == pid and completion.usage.completion_tokens > 0  # type: ignore[attr-defined]


def served_by_raw(sock: socket.socket) -> int:
    """The pid that answers a `GET /v1/models` on an open connection."""
    sock.sendall(f"GET /v1/models HTTP/1.1\r\nhost: gateway\r\nauthorization: Bearer {KEY}\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = sock.recv(65536)
        assert chunk, "connection closed before the response"
        head += chunk
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == PROCESS_HEADER.encode():
            return int(value)
    raise AssertionError(f"no {PROCESS_HEADER} header in {head[:300]!r}")


def test_a_burst_of_kept_alive_connections_spreads_over_both_processes(gateway: Gateway) -> None:
    # 16 connections established before either process accepts one, as a load balancer's or
    # an SDK's pool opens them: with one accept queue for both processes, the first one
    # woken took all 16 in 5 of 6 runs.
    port = int(gateway.url.rsplit(":", 1)[1])
    socks = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(16)]
    try:
        pids = [served_by_raw(sock) for sock in socks]
    finally:
        for sock in socks:
            sock.close()
    counts = {pid: pids.count(pid) for pid in set(pids)}
    assert len(counts) == 2, counts  # by address hash, all 16 on one process has odds 2 in 65,536


def test_a_prefix_cached_through_one_process_is_found_through_the_other(gateway: Gateway) -> None:
    clients = pinned_clients(gateway)
    (first, second) = list(clients)
    for one, other in ((first, second), (second, first)):
        system = {"role": "system", "content": f"Conversation {one}-{time.monotonic()}. " + "Keep context. " * 300}
        turn1 = [system, {"role": "user", "content": "What is a prefix cache?"}]
        served, completion = chat(clients[one], turn1)
        assert served == one
        reply = completion.choices[0].message.content or "Fine."  # type: ignore[attr-defined]
        turn2 = [*turn1, {"role": "assistant", "content": reply}, {"role": "user", "content": "Say more."}]
        served, completion = chat(clients[other], turn2)
        assert served == other
        details = completion.usage.prompt_tokens_details  # type: ignore[attr-defined]
        assert details is not None and details.cached_tokens > 0, completion.usage  # type: ignore[attr-defined]


def test_a_rate_limit_holds_across_processes(gateway: Gateway) -> None:
    clients = pinned_clients(gateway, key=LIMITED_KEY)
    statuses: dict[int, list[int]] = {pid: [] for pid in clients}
    for _ in range(6):  # 12 requests, alternating: a limit per process would let 2 x 5 through
        for pid, client in clients.items():
            try:
                served, _ = chat(client, [{"role": "user", "content": "hi"}])
                assert served == pid
                statuses[pid].append(200)
            except openai.RateLimitError as e:
                assert int(e.response.headers[PROCESS_HEADER]) == pid
                statuses[pid].append(429)
    allowed = sum(s.count(200) for s in statuses.values())
    assert allowed == LIMIT_RPM, statuses  # the test runs in far less than the 12 s one more would take
    assert all(200 in s and 429 in s for s in statuses.values()), statuses


def test_a_killed_process_is_replaced_and_its_stream_ends_in_an_error(gateway: Gateway) -> None:
    clients = pinned_clients(gateway)
    victim, survivor = list(clients)
    stream = clients[victim].chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Tell a long story."}], max_tokens=2000, stream=True,
        extra_body={"ignore_eos": True})
    assert int(stream.response.headers[PROCESS_HEADER]) == victim
    next(iter(stream))
    os.kill(victim, signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises((httpx.HTTPError, openai.APIError)):
        for _ in stream:
            pass
    assert time.monotonic() - started < 5, "the stream of a killed process must fail, not hang"
    # Once the kernel has torn the victim down (its listening socket closes in its exit, after the
    # stream's socket: a connection the kernel queued on it meanwhile is reset, which no code of
    # ours can prevent), every new request is served, by the survivor until the replacement is up.
    deadline = time.monotonic() + 5
    while alive(victim):
        assert time.monotonic() < deadline, "the killed process did not exit"
        time.sleep(0.01)
    replacement = None
    deadline = time.monotonic() + 60
    while replacement is None:
        assert time.monotonic() < deadline, "no replacement process"
        client = new_client(gateway)
        served, completion = chat(client, [{"role": "user", "content": "still there?"}])
        client.close()
        assert served != victim and completion.usage.completion_tokens > 0  # type: ignore[attr-defined]
        if served != survivor:
            replacement = served
    assert not alive(victim)
    assert replacement in supervised_pids(gateway.proc.proc.pid)
    assert len(pinned_clients(gateway)) == 2



def test_no_new_connection_waits_for_a_replacement_process(gateway: Gateway) -> None:
    """A dead process's socket leaves the kernel's balancing at once, and its replacement's
    joins only once it can serve: every connection opened meanwhile goes to the survivor."""
    clients = pinned_clients(gateway)
    victim, survivor = list(clients)
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while victim in supervised_pids(gateway.proc.proc.pid):  # the supervisor has reaped it
        assert time.monotonic() < deadline
        time.sleep(0.02)
    time.sleep(0.1)  # and closed its socket, right after (connections queued before are reset)

    def answer() -> tuple[int, float]:
        opened = time.monotonic()
        with socket.create_connection(("127.0.0.1", gateway.port), timeout=5) as sock:
            return served_by_raw(sock), time.monotonic() - opened

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda _: answer(), range(16)))
    # The replacement takes ~1-2 s to start here: had its socket taken a share of these
    # connections before it could serve, ~8 of them would have waited that long.
    assert survivor in {pid for pid, _ in answers} and victim not in {pid for pid, _ in answers}, answers
    assert max(waited for _, waited in answers) < 0.5, answers
    assert len(pinned_clients(gateway)) == 2  # and the replacement serves once it is up

def embedded_redis(supervisor: int) -> tuple[int, Path]:
    """The supervisor's child that listens on a `redis.sock` (found through /proc/net/unix:
    the server rewrites its command line, and its binary may be a link)."""
    listening = {}
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        fields = line.split()
        if len(fields) >= 8 and fields[7].endswith("/redis.sock"):
            listening[f"socket:[{fields[6]}]"] = Path(fields[7])
    for pid in supervised_pids(supervisor):
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                link = os.readlink(fd)
            except OSError:
                continue
            if link in listening:
                return pid, listening[link]
    raise AssertionError("no embedded Redis on a Unix socket")


def test_sigterm_drains_every_process_then_everything_is_gone(cluster: SimCluster, tmp_path: Path) -> None:
    gateway = start_gateway(tmp_path, cluster, "shutdown_delay_s = 1.0\nshutdown_grace_s = 20.0")
    try:
        supervisor = gateway.proc.proc.pid
        redis_pid, sock = embedded_redis(supervisor)
        assert stat.S_ISSOCK(sock.stat().st_mode) and stat.S_IMODE(sock.parent.stat().st_mode) == 0o700
        with redis.Redis(unix_socket_path=str(sock)) as r:
            assert r.ping() and r.config_get("port")["port"] == "0"  # no TCP port at all
        clients = pinned_clients(gateway)
        results: dict[int, list[str]] = {}

        def stream_on(pid: int, first_chunk: threading.Event) -> None:
            chunks = clients[pid].chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Tell a story."}], max_tokens=300, stream=True,
                extra_body={"ignore_eos": True})
            finish = []
            for chunk in chunks:
                first_chunk.set()
                finish += [c.finish_reason for c in chunk.choices if c.finish_reason]
            results[pid] = finish  # type: ignore[assignment]

        started = {pid: threading.Event() for pid in clients}
        threads = [threading.Thread(target=stream_on, args=(pid, started[pid])) for pid in clients]
        for t in threads:
            t.start()
        for event in started.values():
            assert event.wait(20)
        os.kill(supervisor, signal.SIGTERM)
        time.sleep(0.3)
        ready = httpx.get(gateway.url + "/ready", timeout=5)  # a new connection, during the delay
        assert ready.status_code == 503 and ready.json()["status"] == "shutting_down"
        for t in threads:
            t.join(30)
        assert results == {pid: ["length"] for pid in clients}  # each stream in flight ran to its end
        assert gateway.proc.proc.wait(timeout=30) == 0
        for pid in [*clients, redis_pid]:
            assert not alive(pid), pid
        assert not sock.exists() and not sock.parent.exists()
        with pytest.raises(OSError), socket.create_connection(("127.0.0.1", gateway.port), timeout=1):
            pass
    finally:
        gateway.stop()


def test_a_stop_sent_to_the_whole_process_group_keeps_the_drain_delay(cluster: SimCluster, tmp_path: Path) -> None:
    """A SIGTERM to the process group (systemd's default KillMode, launch.Gateway.stop) reaches each
    gateway process directly and again through the supervisor: that repeat is the same stop, so the
    port stays open through the delay with /ready at 503. The supervisor's own second signal still
    skips the delay."""
    gateway = start_gateway(tmp_path, cluster, "shutdown_delay_s = 60.0\nshutdown_grace_s = 5.0")
    try:
        supervisor = gateway.proc.proc.pid
        pids = list(pinned_clients(gateway))
        for pid in pids:  # the group signal's direct copies, handled before the forwarded ones come
            os.kill(pid, signal.SIGTERM)
        time.sleep(0.5)
        os.kill(supervisor, signal.SIGTERM)  # forwarded to each process as a second SIGTERM
        time.sleep(0.5)
        for _ in range(4):  # new connections, spread over both processes
            ready = httpx.get(gateway.url + "/ready", timeout=5)
            assert ready.status_code == 503 and ready.json()["status"] == "shutting_down"
        assert gateway.proc.proc.poll() is None and all(alive(pid) for pid in pids)
        os.kill(supervisor, signal.SIGTERM)  # a second stop: the rest of the 60 s delay is skipped
        assert gateway.proc.proc.wait(timeout=30) == 0
        assert not any(alive(pid) for pid in pids)
    finally:
        gateway.stop()


def test_a_killed_supervisor_leaves_nothing_running(cluster: SimCluster, tmp_path: Path) -> None:
    """SIGKILL gives the supervisor no chance to stop anything: its gateway processes notice
    and drain, and Linux ends the embedded Redis with it (a parent-death signal)."""
    gateway = start_gateway(tmp_path, cluster, "shutdown_delay_s = 0.2\nshutdown_grace_s = 5.0")
    try:
        supervisor = gateway.proc.proc.pid
        redis_pid, sock = embedded_redis(supervisor)
        children = supervised_pids(supervisor)  # the gateway processes, Redis, multiprocessing's tracker
        clients = pinned_clients(gateway)
        assert {redis_pid, *clients} < children
        stream = next(iter(clients.values())).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Tell a story."}], max_tokens=200, stream=True,
            extra_body={"ignore_eos": True})
        chunks = iter(stream)
        next(chunks)
        os.kill(supervisor, signal.SIGKILL)
        gateway.proc.proc.wait(timeout=5)
        # The stream in flight still runs to its end, although the shared Redis went at once.
        assert [c.finish_reason for chunk in chunks for c in chunk.choices if c.finish_reason] == ["length"]
        deadline = time.monotonic() + 20
        while running := [pid for pid in children if alive(pid)]:
            assert time.monotonic() < deadline, running
            time.sleep(0.1)
        assert not sock.exists()
        with pytest.raises(OSError), socket.create_connection(("127.0.0.1", gateway.port), timeout=1):
            pass
    finally:
        gateway.stop()
