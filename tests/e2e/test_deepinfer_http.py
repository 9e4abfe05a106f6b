"""DeepInferEngine (with the interface double) behind the real worker server on loopback."""

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
    HEALTH_PATH,
    INFO_PATH,
    KV_EVENTS_PATH,
    LOAD_PATH,
    Role,
)
from deepinfer_gateway.infra.asgi import ServedApp, serve_app
from deepinfer_gateway.workers.deepinfer import DeepInferConfig, DeepInferEngine, MemoryKvStore
from deepinfer_gateway.workers.server import create_worker_app
from tests.deepinfer_double import DoubleKvTransfer, core


@pytest.fixture
async def workers(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[dict[str, ServedApp]]:
    monkeypatch.setattr(core, "STEP_DELAY_S", 0.002)
    store = MemoryKvStore()
    served: dict[str, ServedApp] = {}
    for role in (Role.UNIFIED, Role.PREFILL, Role.DECODE):
        config = DeepInferConfig(model="/m", role=role, worker_id=f"di-{role.value}", drain_timeout_s=0)
        engine = DeepInferEngine(
            config, api_root="tests.deepinfer_double", kv_store=store, kv_transfer=DoubleKvTransfer()
        )
        served[role.value] = await serve_app(create_worker_app(engine))
    yield served
    await asyncio.gather(*(app.stop() for app in served.values()))


async def generate(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    async with http.post(url + GENERATE_PATH, json=body) as resp:
        assert resp.status == 200
        return [orjson.loads(line) async for line in resp.content if line.strip()]


def tokens(events: list[dict[str, Any]]) -> list[int]:
    return [t for e in events if e["event"] == "tokens" for t in e["token_ids"]]


async def test_generate_abort_and_reports_over_http(workers: dict[str, ServedApp]) -> None:
    url = workers["unified"].url
    async with aiohttp.ClientSession() as http:
        events = await generate(
            http, url, {"request_id": "g", "token_ids": [11, 12, 13], "sampling": {"max_tokens": 6}}
        )
        assert events[0]["event"] == "ready" and events[-1] == {
            "event": "finish",
            "reason": "length",
            "num_output_tokens": 6,
        }

        body = {"request_id": "ab", "token_ids": [11, 12, 13], "sampling": {"max_tokens": 100_000}}
        async with http.post(url + GENERATE_PATH, json=body) as resp:
            lines = resp.content.__aiter__()
            assert orjson.loads(await anext(lines))["event"] == "ready"
            assert orjson.loads(await anext(lines))["event"] == "tokens"
            async with http.post(url + ABORT_PATH, json={"request_id": "ab"}) as aborted:
                assert await aborted.json() == {"aborted": True}
            rest = [orjson.loads(line) async for line in lines if line.strip()]
        assert rest[-1]["reason"] == "abort"

        async with http.get(url + LOAD_PATH) as resp:
            load = await resp.json()
        assert load["worker_id"] == "di-unified" and load["prompt_tokens_total"] == 6
        async with http.get(url + INFO_PATH) as resp:
            info = await resp.json()
        assert info["engine"] == "deepinfer" and info["protocol_version"] == 1
        async with http.get(url + KV_EVENTS_PATH, params={"after": 0}) as resp:
            assert [e["kind"] for e in (await resp.json())["events"]] == ["cleared"]
        async with http.get(url + HEALTH_PATH) as resp:
            assert resp.status == 200 and (await resp.json())["epoch"] == info["epoch"]


async def test_prefill_decode_over_http(workers: dict[str, ServedApp]) -> None:
    prompt = [10 + (i * 13) % 900 for i in range(260)]
    sampling = {"max_tokens": 9}
    async with aiohttp.ClientSession() as http:
        whole = await generate(
            http, workers["unified"].url, {"request_id": "w", "token_ids": prompt, "sampling": sampling}
        )
        pre = await generate(
            http,
            workers["prefill"].url,
            {"request_id": "p", "token_ids": prompt, "sampling": sampling, "role": "prefill"},
        )
        first = tokens(pre)
        body = {
            "request_id": "d",
            "token_ids": prompt + first,
            "sampling": sampling,
            "role": "decode",
            "kv_handoff": pre[-1]["kv_handoff"],
        }
        dec = await generate(http, workers["decode"].url, body)
    assert first + tokens(dec) == tokens(whole) and dec[-1]["reason"] == whole[-1]["reason"] == "length"
    assert dec[0]["cached_tokens"] == {"memory": 0, "store": 260}
