"""OpenAI/SGLang-compatible endpoints of a sim worker (what third-party routers call)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from deepinfer_gateway.workers.sim.cluster import InProcessSimCluster, SimWorkerSpec, serve_sim_cluster

MODEL = "DeepSeek-V4.1-Flash"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.fixture(scope="module")
async def url() -> AsyncIterator[str]:
    cluster: InProcessSimCluster = await serve_sim_cluster([SimWorkerSpec("c0", time_scale=1000.0)])
    yield cluster.urls["c0"]
    await cluster.stop()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def sse(resp: aiohttp.ClientResponse) -> list[Any]:
    out = []
    async for line in resp.content:
        if line.startswith(b"data: "):
            data = line[6:].strip()
            out.append(data.decode() if data == b"[DONE]" else json.loads(data))
    return out


async def test_chat_non_streaming_reports_cached_tokens(url: str, http: aiohttp.ClientSession) -> None:
    long = "The quick brown fox jumps over the lazy dog. " * 400
    body = {"model": MODEL, "messages": [{"role": "system", "content": long}, {"role": "user", "content": "hi"}]}
    async with http.post(url + "/v1/chat/completions", json=body) as resp:
        first = await resp.json()
    async with http.post(url + "/v1/chat/completions", json={**body, "messages": [*body["messages"][:1], {"role": "user", "content": "again"}]}) as resp:
        second = await resp.json()
    message = second["choices"][0]["message"]
    assert message["content"] and message["reasoning_content"]
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= 3000


async def test_chat_streaming_tool_call(url: str, http: aiohttp.ClientSession) -> None:
    body = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "weather?"}], "tools": TOOLS}
    async with http.post(url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200 and resp.content_type == "text/event-stream"
        events = await sse(resp)
    assert events[-1] == "[DONE]"
    calls = [c for e in events[:-1] for ch in e["choices"] for c in ch["delta"].get("tool_calls") or []]
    assert calls[0]["function"]["name"] == "get_weather"
    assert json.loads("".join(c["function"].get("arguments") or "" for c in calls)) == {"city": "Paris"}


async def test_chat_conversion_error_is_4xx(url: str, http: aiohttp.ClientSession) -> None:
    async with http.post(url + "/v1/chat/completions", json={"model": "nope", "messages": []}) as resp:
        assert 400 <= resp.status < 500


async def test_completions_and_sglang_generate(url: str, http: aiohttp.ClientSession) -> None:
    async with http.post(url + "/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 5}) as resp:
        done = await resp.json()
    assert done["choices"][0]["finish_reason"] == "length" and done["usage"]["completion_tokens"] == 5
    async with http.post(url + "/v1/completions", json={"model": MODEL, "prompt": [1000, 1001], "max_tokens": 3, "stream": True}) as resp:
        events = await sse(resp)
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
    async with http.post(url + "/generate", json={"text": "Hello", "sampling_params": {"max_new_tokens": 4}}) as resp:
        gen = await resp.json()
    assert len(gen["output_ids"]) == 4 and gen["meta_info"]["finish_reason"] == {"type": "length"}
    async with http.post(url + "/generate", json={"input_ids": [5, 6, 7], "stream": True, "sampling_params": {"max_new_tokens": 2}}) as resp:
        events = await sse(resp)
    assert events[-1] == "[DONE]" and events[-2]["meta_info"]["completion_tokens"] == 2


async def test_discovery_load_and_tokenize(url: str, http: aiohttp.ClientSession) -> None:
    for path in ("/health", "/health_generate", "/v1/models", "/model_info", "/get_model_info"):
        async with http.get(url + path) as resp:
            assert resp.status == 200, path
    async with http.get(url + "/get_server_info") as resp:
        info = await resp.json()
    assert info["served_model_name"] == MODEL and info["dp_size"] == 4 and info["disaggregation_mode"] == "null"
    assert (Path(info["model_path"]) / "tokenizer.json").is_file()
    async with http.get(url + "/get_load") as resp:
        load = await resp.json()
    assert [r["dp_rank"] for r in load] == [0, 1, 2, 3] and {"num_reqs", "num_waiting_reqs", "num_tokens"} <= set(load[0])
    async with http.post(url + "/tokenize", json={"prompt": "Hello world"}) as resp:
        tok = await resp.json()
    assert tok["count"] == len(tok["tokens"]) > 0
    async with http.post(url + "/v1/chat/completions/render", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}) as resp:
        rendered = await resp.json()
    assert rendered["prompt_token_ids"][-1] == 128821  # <think>
