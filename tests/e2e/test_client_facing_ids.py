"""What a client learns of the workers behind the gateway (real gateway and sim workers on
loopback): its own x-request-id comes back but is not the worker's (two requests with the
same one both succeed), and no worker address: not in x-dgw-worker (a digest of it), not in
a 502's body, not in a mid-stream error frame."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import httpx
import pytest

from deepinfer_gateway.gateway.fleet.client_ids import digest_of
from harness.launch import Gateway, SimCluster

MODEL = "DeepSeek-V4.1-Flash"


def _body(text: str, max_tokens: int, stream: bool) -> dict[str, object]:
    return {"model": MODEL, "max_tokens": max_tokens, "stream": stream, "thinking": {"type": "disabled"},
            "messages": [{"role": "user", "content": text}]}


@pytest.fixture
def one_worker(tmp_path: Path) -> Iterator[tuple[SimCluster, Gateway]]:
    """One sim worker (so requests meet on it); health checks far apart, so a worker killed
    mid-test is still a candidate when the next request comes."""
    cluster = SimCluster("unified:sm100", time_scale=20.0)
    gateway = None
    try:
        gateway = Gateway(tmp_path, [(cluster.urls[0], "unified", "sm100")], health_interval_s=60.0,
                          extra_toml="max_attempts = 1\n")
        gateway.wait_ready(1)
        yield cluster, gateway
    finally:
        if gateway is not None:
            gateway.stop()
        cluster.stop()


def _address(cluster: SimCluster) -> str:
    return cluster.urls[0].split("://", 1)[1]


async def _stream(session: aiohttp.ClientSession, url: str, body: dict[str, object],
                  headers: dict[str, str]) -> tuple[int, str, list[str]]:
    async with session.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
        return r.status, r.headers.get("x-request-id", ""), [line async for line in _lines(r)]


async def _lines(r: aiohttp.ClientResponse) -> AsyncIterator[str]:
    async for raw in r.content:
        if raw.strip():
            yield raw.decode().strip()


def test_two_concurrent_streams_with_the_same_request_id_both_succeed(
        one_worker: tuple[SimCluster, Gateway]) -> None:
    _, gateway = one_worker

    async def both() -> list[tuple[int, str, list[str]]]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            same = {"x-request-id": "client-chosen-id"}
            return list(await asyncio.gather(*(
                _stream(session, gateway.url, _body(f"same id {i}", 48, True), same) for i in range(2))))

    for status, echoed, lines in asyncio.run(both()):
        assert len(lines) > 3  # streamed tokens, not only the head and [DONE]
        assert status == 200 and echoed == "client-chosen-id"
        assert lines[-1] == "data: [DONE]" and not any('"error"' in line for line in lines), lines[-3:]


def test_a_dead_workers_502_names_no_address(one_worker: tuple[SimCluster, Gateway]) -> None:
    cluster, gateway = one_worker
    cluster.proc.kill()  # the gateway still counts it healthy (next check in a minute)
    reply = httpx.post(gateway.url + "/v1/chat/completions", json=_body("to a dead worker", 8, False), timeout=30)
    assert reply.status_code == 502, reply.text
    assert reply.json()["error"]["message"].startswith("All 1 attempted workers failed: ")
    assert _address(cluster) not in reply.text and str(cluster.base_port) not in reply.text


def test_a_mid_stream_error_frame_names_no_address(one_worker: tuple[SimCluster, Gateway]) -> None:
    cluster, gateway = one_worker

    async def cut() -> list[str]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            body = {**_body("a long answer the worker dies in", 4000, True), "min_tokens": 4000}
            async with session.post(gateway.url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200
                lines = []
                async for line in _lines(r):
                    lines.append(line)
                    if len(lines) == 3:
                        cluster.proc.kill()  # the worker dies mid-answer
                return lines

    started = time.monotonic()
    lines = asyncio.run(cut())
    errors = [json.loads(line[len("data: "):]) for line in lines if '"error"' in line]
    assert errors, (lines[-3:], time.monotonic() - started)
    frame = json.dumps(errors)
    assert "failed mid-stream" in frame
    assert _address(cluster) not in frame and str(cluster.base_port) not in frame


def test_the_worker_header_is_not_its_address(one_worker: tuple[SimCluster, Gateway]) -> None:
    cluster, gateway = one_worker
    reply = httpx.post(gateway.url + "/v1/chat/completions", json=_body("which worker", 4, False), timeout=30)
    assert reply.status_code == 200, reply.text
    shown = reply.headers["x-dgw-worker"]
    assert shown == digest_of(_address(cluster)) and str(cluster.base_port) not in shown
