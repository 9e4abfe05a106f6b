"""One /metrics for a host that runs the gateway as several processes (PROMETHEUS_MULTIPROC_DIR).

Two real `serve` processes share a multiprocess folder in front of one sim cluster, as the
`serve --processes` supervisor runs them; requests go through each with the openai SDK.
Either process's /metrics then reports the host: counters and histograms summed over both,
one series per worker for the load gauges, in-flight requests summed over live processes,
each process's CPU. A process killed and marked dead (`mark_process_dead`, the supervisor's
part) drops its gauges and CPU series while its counts stay; a removed worker's series are
hidden by the process that removed it although the other still writes them. Last, the same
through `serve --processes 2`: the supervisor's children, a killed one replaced and marked dead.
"""

from __future__ import annotations

import hashlib
import os
import signal
import time
import urllib.error
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.multiprocess import mark_process_dead

from deepinfer_gateway.gateway.telemetry.metrics_host import MULTIPROC_ENV
from harness.launch import Gateway, SimCluster
from tests.fault_doubles import scrape, scrape_until, total

MODEL = "DeepSeek-V4.1-Flash"
ADMIN_KEY = "multiprocess-admin"
KEYS_TOML = f"""
[[api_keys]]
name = "admin"
key_sha256 = "{hashlib.sha256(ADMIN_KEY.encode()).hexdigest()}"
admin = true
"""
WORKER_GAUGES = ("dgw_worker_healthy", "dgw_worker_queue_tokens", "dgw_worker_running_requests",
                 "dgw_worker_kv_usage_ratio")
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@pytest.fixture(scope="module")
def cluster() -> Iterator[SimCluster]:
    # Real-time decode (~3 ms a token): a long answer stays in flight while the test scrapes.
    sim = SimCluster("unified:sm100,unified:ascend950", time_scale=1.0)
    yield sim
    sim.stop()


@pytest.fixture
def host(cluster: SimCluster, tmp_path: Path) -> Iterator[tuple[Gateway, Gateway, Path]]:
    """Two gateway processes of one host: the same workers, one shared multiprocess folder."""
    shared = tmp_path / "prometheus"
    shared.mkdir()
    workers = [(url, "unified", spec.split(":")[1]) for url, spec in zip(cluster.urls, cluster.specs, strict=True)]
    gateways = [Gateway(tmp_path, workers, extra_toml=KEYS_TOML, env={MULTIPROC_ENV: str(shared)})
                for _ in range(2)]
    try:
        for gw in gateways:
            gw.wait_ready(2)
        yield gateways[0], gateways[1], shared
    finally:
        for gw in gateways:
            gw.stop()


def _client(gw: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=ADMIN_KEY, max_retries=0, timeout=60)


def _chat(gw: Gateway, content: str, stream: bool) -> tuple[int, int]:
    """One chat request: (prompt tokens, completion tokens) as the client was told."""
    messages: list[Any] = [{"role": "user", "content": content}]
    if stream:
        chunks = _client(gw).chat.completions.create(model=MODEL, messages=messages, max_tokens=24, stream=True,
                                                     stream_options={"include_usage": True})
        usage = [c.usage for c in chunks if c.usage is not None][-1]
    else:
        answer = _client(gw).chat.completions.create(model=MODEL, messages=messages, max_tokens=24)
        assert answer.usage is not None
        usage = answer.usage
    return usage.prompt_tokens, usage.completion_tokens


def _open_stream(gw: Gateway, content: str) -> openai.Stream[Any]:
    """A long streamed answer, read up to its first chunk and left open: in flight."""
    stream = _client(gw).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                                 max_tokens=20000, stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))
    return stream


def _series(samples: Samples, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {labels: v for (n, labels), v in samples.items() if n == name}


def _cpu_pids(samples: Samples) -> dict[int, float]:
    return {int(dict(labels)["pid"]): v for labels, v in _series(samples, "dgw_process_cpu_seconds_total").items()}


def test_either_process_reports_the_sums_of_both(host: tuple[Gateway, Gateway, Path], cluster: SimCluster) -> None:
    a, b, _ = host
    served = [_chat(a, f"Process A, request {i}: streamed.", stream=True) for i in range(3)]
    served += [_chat(b, f"Process B, request {i}: whole.", stream=False) for i in range(2)]
    scrape_until(a.url, "dgw_requests_total", len(served), protocol="chat", status="200")

    worker_ids = {url.removeprefix("http://") for url in cluster.urls}
    for gw in (a, b):
        samples = scrape_until(gw.url, "dgw_requests_total", len(served), protocol="chat", status="200")
        assert total(samples, "dgw_requests_total", protocol="chat", status="200") == len(served)
        assert total(samples, "dgw_time_to_first_token_seconds_count", model=MODEL) == len(served)
        assert total(samples, "dgw_time_to_first_token_seconds_bucket", le="+Inf") == len(served)
        assert total(samples, "dgw_request_prompt_tokens_sum") == sum(p for p, _ in served)
        assert total(samples, "dgw_request_generation_tokens_sum") == sum(c for _, c in served)
        assert total(samples, "dgw_inter_token_latency_seconds_count") > 0  # A's streams
        assert total(samples, "dgw_inflight_requests") == 0
        # Gauges every process sets for the same worker: one series each, no pid label.
        for name in WORKER_GAUGES:
            assert set(_series(samples, name)) == {(("worker", w),) for w in worker_ids}, name
        assert set(_series(samples, "dgw_worker_healthy").values()) == {1.0}
        # CPU: one series per process, read at scrape time from whichever process answers.
        cpu = _cpu_pids(samples)
        assert set(cpu) == {a.proc.proc.pid, b.proc.proc.pid} and min(cpu.values()) > 0
        assert len(_series(samples, "dgw_build_info")) == 1
        assert [n for n, labels in samples if "pid" in dict(labels) and n != "dgw_process_cpu_seconds_total"] == []


def test_a_dead_process_drops_its_gauges_and_keeps_its_counts(host: tuple[Gateway, Gateway, Path]) -> None:
    a, b, shared = host
    b_pid = b.proc.proc.pid
    for i in range(2):
        _chat(b, f"Counted by B before it dies, {i}.", stream=False)
    _chat(a, "Counted by A.", stream=False)
    scrape_until(a.url, "dgw_requests_total", 3, status="200")
    held = [_open_stream(a, "A long answer through A."), _open_stream(b, "A long answer through B.")]
    try:
        samples = scrape(a.url)
        assert total(samples, "dgw_inflight_requests") == 2
        assert set(_cpu_pids(samples)) == {a.proc.proc.pid, b_pid}

        b.proc.kill()  # SIGKILL: B's request never finishes, its in-flight file still says 1
        assert total(scrape(a.url), "dgw_inflight_requests") == 2
        mark_process_dead(b_pid, str(shared))

        samples = scrape(a.url)
        assert total(samples, "dgw_inflight_requests") == 1
        assert set(_cpu_pids(samples)) == {a.proc.proc.pid}
        # B's counts stay: 3 finished requests, 5 first tokens (the two held streams' too).
        assert total(samples, "dgw_requests_total", status="200") == 3
        assert total(samples, "dgw_time_to_first_token_seconds_count") == 5
        assert len(_series(samples, "dgw_worker_healthy")) == 2  # A still reports both workers
    finally:
        for stream in held:
            stream.close()


def test_a_removed_worker_is_hidden_although_another_process_still_writes_it(
        host: tuple[Gateway, Gateway, Path], cluster: SimCluster) -> None:
    a, b, _ = host
    gone = cluster.urls[1].removeprefix("http://")
    kept = cluster.urls[0].removeprefix("http://")
    removed = httpx.delete(f"{a.url}/admin/workers/{gone}", headers={"authorization": f"Bearer {ADMIN_KEY}"})
    assert removed.status_code == 200
    time.sleep(0.5)  # a few more health checks: B keeps writing the worker's gauges meanwhile

    # Without Redis the removal is A's alone: B still checks the worker and writes its series.
    assert total(scrape(b.url), "dgw_worker_healthy", worker=gone) == 1
    after = scrape(a.url)
    assert [name for name, labels in after if ("worker", gone) in labels] == []
    assert total(after, "dgw_worker_healthy", worker=kept) == 1


def _ppid(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2:].split()[1])


def _shared_dir(pid: int) -> Path:
    """The multiprocess folder a process was started with (its environment in /proc)."""
    env = dict(item.split("=", 1) for item in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in item)
    return Path(env[MULTIPROC_ENV])


def _scrape_until_pids(gw: Gateway, done: Callable[[set[int]], bool]) -> Samples:
    """Scrape until the CPU series' pids satisfy `done` (children start and restart on their own).
    A connection that reached a killed child's socket before the supervisor closed it is reset,
    or refused if it was still being set up (supervisor.py): scraped again, as a client retries."""
    deadline = time.monotonic() + 30
    while True:
        try:
            samples = scrape(gw.url)
        except (ConnectionResetError, urllib.error.URLError) as exc:
            reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
            if not isinstance(reason, ConnectionResetError | ConnectionRefusedError) or time.monotonic() > deadline:
                raise
            time.sleep(0.05)
            continue
        if done(set(_cpu_pids(samples))) or time.monotonic() > deadline:
            return samples
        time.sleep(0.1)


def test_serve_processes_reports_every_child_and_keeps_a_replaced_ones_counts(
        cluster: SimCluster, tmp_path: Path) -> None:
    """Through the supervisor (`serve --processes 2`): it sets the folder and marks a dead child."""
    workers = [(url, "unified", spec.split(":")[1]) for url, spec in zip(cluster.urls, cluster.specs, strict=True)]
    gw = Gateway(tmp_path, workers, extra_toml=KEYS_TOML, processes=2)
    try:
        gw.wait_ready(2)
        children = set(_cpu_pids(_scrape_until_pids(gw, lambda pids: len(pids) == 2)))
        assert len(children) == 2 and {_ppid(pid) for pid in children} == {gw.proc.proc.pid}
        shared = _shared_dir(min(children))
        assert _shared_dir(max(children)) == shared
        served = [_chat(gw, f"Through the supervisor, request {i}.", stream=i % 2 == 0) for i in range(6)]
        scrape_until(gw.url, "dgw_requests_total", len(served), protocol="chat", status="200")

        victim, survivor = sorted(children)
        os.kill(victim, signal.SIGKILL)
        samples = _scrape_until_pids(gw, lambda pids: victim not in pids and len(pids) == 2)
        pids = set(_cpu_pids(samples))
        assert victim not in pids and survivor in pids and len(pids) == 2, pids  # replaced
        files = {f.name for f in shared.iterdir()}
        assert f"counter_{victim}.db" in files  # its counts stay in the merge
        assert not [name for name in files if name.startswith("gauge_live") and name.endswith(f"_{victim}.db")]
        assert total(samples, "dgw_requests_total", protocol="chat", status="200") == len(served)
        assert total(samples, "dgw_time_to_first_token_seconds_count") == len(served)
        assert total(samples, "dgw_request_generation_tokens_sum") == sum(c for _, c in served)
        assert total(samples, "dgw_inflight_requests") == 0
        assert len(_series(samples, "dgw_worker_healthy")) == 2
    finally:
        gw.stop()
