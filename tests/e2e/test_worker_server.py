"""Worker protocol v1 over real HTTP on loopback: sim workers served by uvicorn."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest

from deepinfer_gateway.core.protocol import (
    ABORT_PATH,
    GENERATE_PATH,
    INFO_PATH,
    KV_EVENTS_PATH,
    LOAD_PATH,
    KvHandoff,
    Role,
)
from deepinfer_gateway.workers.sim.cluster import InProcessSimCluster, SimWorkerSpec, serve_sim_cluster
from deepinfer_gateway.workers.sim.engine import Failures

FAST = 1000.0  # time_scale: simulated seconds pass 1000x faster


@pytest.fixture(scope="module")
async def cluster() -> AsyncIterator[InProcessSimCluster]:
    c = await serve_sim_cluster(
        [
            SimWorkerSpec("u0", time_scale=FAST),
            SimWorkerSpec("slow", time_scale=0.05),  # long enough to abort mid-stream
            SimWorkerSpec("p0", Role.PREFILL, time_scale=FAST),
            SimWorkerSpec("d0", Role.DECODE, time_scale=FAST),
            SimWorkerSpec("flaky", time_scale=FAST, failures=Failures(fail_after_tokens=3)),
        ],
        compat=False,
    )
    yield c
    await c.stop()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def generate(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    async with http.post(url + GENERATE_PATH, json=body) as resp:
        assert resp.status == 200 and resp.content_type == "application/x-ndjson"
        return [orjson.loads(line) async for line in resp.content if line.strip()]


def text_prompt(n: int, seed: int = 0) -> list[int]:
    return [1000 + (i * 7 + seed) % 5000 for i in range(n)]


async def test_stream_is_ready_tokens_finish(cluster: InProcessSimCluster, http: aiohttp.ClientSession) -> None:
    events = await generate(http, cluster.urls["u0"],
                            {"request_id": "r1", "token_ids": text_prompt(300), "sampling": {"max_tokens": 20}})
    assert events[0] == {"event": "ready", "prompt_tokens": 300, "cached_tokens": {"memory": 0, "store": 0}}
    assert all(e["event"] == "tokens" for e in events[1:-1])
    tokens = [t for e in events[1:-1] for t in e["token_ids"]]
    assert events[-1] == {"event": "finish", "reason": "length", "num_output_tokens": 20} and len(tokens) == 20


async def test_shared_prefix_is_cached_on_the_same_worker(cluster: InProcessSimCluster,
                                                          http: aiohttp.ClientSession) -> None:
    shared = text_prompt(8000, seed=1)
    url = cluster.urls["u0"]
    await generate(http, url, {"request_id": "a", "token_ids": shared + [11, 12], "sampling": {"max_tokens": 2}})
    events = await generate(http, url,
                            {"request_id": "b", "token_ids": shared + [13, 14, 15], "sampling": {"max_tokens": 2}})
    assert events[0]["cached_tokens"]["memory"] >= 7936
    async with http.get(url + LOAD_PATH) as resp:
        load = await resp.json()
    assert load["cached_tokens_total"]["memory"] >= 7936


async def test_store_tier_serves_another_worker(cluster: InProcessSimCluster, http: aiohttp.ClientSession) -> None:
    prompt = text_prompt(2000, seed=2)
    await generate(http, cluster.urls["u0"], {"request_id": "s1", "token_ids": prompt, "sampling": {"max_tokens": 1}})
    events = await generate(http, cluster.urls["flaky"],
                            {"request_id": "s2", "token_ids": prompt, "sampling": {"max_tokens": 1}})
    assert events[0]["cached_tokens"] == {"memory": 0, "store": 15 * 128}


async def test_kv_events_endpoint(cluster: InProcessSimCluster, http: aiohttp.ClientSession) -> None:
    url = cluster.urls["u0"]
    await generate(http, url,
                   {"request_id": "e1", "token_ids": text_prompt(1000, seed=3), "sampling": {"max_tokens": 1}})
    async with http.get(url + KV_EVENTS_PATH, params={"after": 0, "limit": 1000}) as resp:
        batch = await resp.json()
    async with http.get(url + INFO_PATH) as resp:
        info = await resp.json()
    assert batch["epoch"] == info["epoch"] and info["protocol_version"] == 1
    assert batch["events"][0]["kind"] == "cleared"
    assert [e["seq"] for e in batch["events"]] == list(range(1, batch["last_seq"] + 1))
    assert {(e["kind"], e["tier"]) for e in batch["events"][1:]} >= {("stored", "memory"), ("stored", "store")}
    async with http.get(url + KV_EVENTS_PATH, params={"after": batch["last_seq"]}) as resp:
        assert (await resp.json())["events"] == []


async def wait_idle(http: aiohttp.ClientSession, url: str, within: float = 1.0) -> dict[str, Any]:
    deadline = asyncio.get_running_loop().time() + within
    while True:
        async with http.get(url + LOAD_PATH) as resp:
            load: dict[str, Any] = await resp.json()
        if load["running"] + load["waiting"] == 0 or asyncio.get_running_loop().time() > deadline:
            return load
        await asyncio.sleep(0.02)


async def test_abort_endpoint(cluster: InProcessSimCluster, http: aiohttp.ClientSession) -> None:
    url = cluster.urls["slow"]
    body = {"request_id": "ab", "token_ids": text_prompt(100), "sampling": {"max_tokens": 5000, "ignore_eos": True}}
    async with http.post(url + GENERATE_PATH, json=body) as resp:
        first = orjson.loads(await resp.content.readline())
        assert first["event"] == "ready"
        async with http.post(url + ABORT_PATH, json={"request_id": "ab"}) as aborted:
            assert await aborted.json() == {"aborted": True}
        rest = [orjson.loads(line) async for line in resp.content if line.strip()]
    assert rest[-1]["event"] == "finish" and rest[-1]["reason"] == "abort"
    load = await wait_idle(http, url)
    assert load["running"] == 0 and load["kv_usage"] == 0


async def test_client_disconnect_aborts(cluster: InProcessSimCluster, http: aiohttp.ClientSession) -> None:
    url = cluster.urls["slow"]
    body = {"request_id": "dc", "token_ids": text_prompt(100), "sampling": {"max_tokens": 5000, "ignore_eos": True}}
    resp = await http.post(url + GENERATE_PATH, json=body)
    await resp.content.readline()
    await resp.content.readline()
    resp.close()  # drop the connection mid-stream
    load = await wait_idle(http, url, within=1.0)
    assert load["running"] + load["waiting"] == 0


@pytest.mark.parametrize(
    ("path", "payload", "status"),
    [
        (GENERATE_PATH, b"not json", 400),
        (GENERATE_PATH, b'{"request_id": "x"}', 422),
        (GENERATE_PATH, b'{"request_id": "x", "token_ids": [], "sampling": {}}', 422),
        (GENERATE_PATH, b'{"request_id": "x", "token_ids": [1], "sampling": {"max_tokens": 0}}', 422),
        (ABORT_PATH, b"[]", 422),
    ],
)
async def test_malformed_bodies_are_4xx(cluster: InProcessSimCluster, http: aiohttp.ClientSession, path: str,
                                        payload: bytes, status: int) -> None:
    async with http.post(cluster.urls["u0"] + path, data=payload, headers={"content-type": "application/json"}) as resp:
        assert resp.status == status
        assert (await resp.json())["error"]["kind"] == "invalid_request"


async def test_bad_tokens_finish_with_client_error(cluster: InProcessSimCluster, http: aiohttp.ClientSession) -> None:
    (event,) = await generate(http, cluster.urls["u0"], {"request_id": "bad", "token_ids": [1, 10**9]})
    assert event["reason"] == "error" and event["error"]["kind"] == "invalid_tokens" and not event["error"]["retryable"]


async def test_injected_failure_is_retryable(cluster: InProcessSimCluster, http: aiohttp.ClientSession) -> None:
    events = await generate(http, cluster.urls["flaky"],
                            {"request_id": "f", "token_ids": text_prompt(50), "sampling": {"max_tokens": 50}})
    assert sum(len(e.get("token_ids", [])) for e in events) == 3
    assert events[-1]["error"] == {"kind": "engine", "message": "injected failure", "retryable": True}


async def test_prefill_then_decode_hand_off(cluster: InProcessSimCluster, http: aiohttp.ClientSession) -> None:
    prompt = text_prompt(1000, seed=5)
    sampling = {"max_tokens": 30, "seq_seed": 7}
    whole = await generate(http, cluster.urls["u0"], {"request_id": "w", "token_ids": prompt, "sampling": sampling})
    expected = [t for e in whole if e["event"] == "tokens" for t in e["token_ids"]]

    pre = await generate(http, cluster.urls["p0"],
                         {"request_id": "p", "token_ids": prompt, "sampling": sampling, "role": "prefill"})
    first = [t for e in pre if e["event"] == "tokens" for t in e["token_ids"]]
    finish = pre[-1]
    assert first == expected[:1] and finish["reason"] == "stop"
    handoff = KvHandoff.model_validate(finish["kv_handoff"])
    assert handoff.num_tokens == 1000 and len(handoff.block_hashes) == 7 and handoff.handle.startswith("store:")

    body = {"request_id": "d", "token_ids": prompt + first, "sampling": sampling, "role": "decode",
            "kv_handoff": finish["kv_handoff"]}
    dec = await generate(http, cluster.urls["d0"], body)
    rest = [t for e in dec if e["event"] == "tokens" for t in e["token_ids"]]
    assert first + rest == expected and dec[-1]["reason"] == whole[-1]["reason"]

    wrong = await generate(http, cluster.urls["d0"],
                           {**body, "request_id": "d2", "kv_handoff": {**finish["kv_handoff"], "kv_format": "other"}})
    assert wrong[-1]["error"]["kind"] == "kv_transfer"
    refused = await generate(http, cluster.urls["p0"], {**body, "request_id": "d3"})
    assert refused[-1]["error"]["kind"] == "invalid_request"
