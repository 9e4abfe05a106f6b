"""OpenAI/SGLang-compatible endpoints of a sim worker (what third-party routers call)."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import deepseek_recipe as dr
import pytest
from openai import AsyncOpenAI

from deepinfer_gateway.recipe_bridge.encoder import ReferencePromptEncoder
from deepinfer_gateway.recipe_bridge.tokenizer import load_tokenizer
from deepinfer_gateway.workers.sim.cluster import (
    InProcessSimCluster,
    SimWorkerSpec,
    serve_sim_cluster,
)
from deepinfer_gateway.workers.sim.compat import shared_encoder
from harness.launch import CLI, free_port, wait_for_port

MODEL = "DeepSeek-V4.1-Flash"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.fixture(scope="module")
async def cluster() -> AsyncIterator[InProcessSimCluster]:
    served = await serve_sim_cluster([SimWorkerSpec("c0", time_scale=1000.0), SimWorkerSpec("c1", time_scale=1000.0)])
    yield served
    await served.stop()


@pytest.fixture(scope="module")
async def url(cluster: InProcessSimCluster) -> str:
    return cluster.urls["c0"]


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
    again = {**body, "messages": [*body["messages"][:1], {"role": "user", "content": "again"}]}
    async with http.post(url + "/v1/chat/completions", json=again) as resp:
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
    async with http.post(url + "/v1/completions",
                         json={"model": MODEL, "prompt": [1000, 1001], "max_tokens": 3, "stream": True}) as resp:
        events = await sse(resp)
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
    async with http.post(url + "/generate", json={"text": "Hello", "sampling_params": {"max_new_tokens": 4}}) as resp:
        gen = await resp.json()
    assert len(gen["output_ids"]) == 4 and gen["meta_info"]["finish_reason"] == {"type": "length"}
    stream = {"input_ids": [5, 6, 7], "stream": True, "sampling_params": {"max_new_tokens": 2}}
    async with http.post(url + "/generate", json=stream) as resp:
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
    assert [r["dp_rank"] for r in load] == [0, 1, 2, 3]
    assert {"num_reqs", "num_waiting_reqs", "num_tokens"} <= set(load[0])
    async with http.post(url + "/tokenize", json={"prompt": "Hello world"}) as resp:
        tok = await resp.json()
    assert tok["count"] == len(tok["tokens"]) > 0
    async with http.post(url + "/v1/chat/completions/render",
                         json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}) as resp:
        rendered = await resp.json()
    assert rendered["prompt_token_ids"][-1] == 128821  # <think>


async def test_render_is_the_reference_encoding_and_shared_by_workers(cluster: InProcessSimCluster,
                                                                      http: aiohttp.ClientSession) -> None:
    system = "You are terse. " * 300 + f"{time.time_ns()}"  # unseen text: the first render must tokenize it
    body = {"model": MODEL, "tools": TOOLS, "messages": [
        {"role": "system", "content": system},
        {"role": "user", "content": "Weather in Paris? <｜User｜> typed, not special."}]}
    encoder = shared_encoder(load_tokenizer())
    rendered = []
    for wid in ("c0", "c1"):
        before = encoder.cache_stats()
        async with http.post(cluster.urls[wid] + "/v1/chat/completions/render", json=body) as resp:
            assert resp.status == 200
            rendered.append(await resp.json())
        after = encoder.cache_stats()
        if wid == "c0":
            assert after.misses > before.misses
        else:  # the second worker reads every segment the first one tokenized
            assert after.misses == before.misses and after.hits > before.hits
    reference = ReferencePromptEncoder(load_tokenizer()).encode(
        dr.ChatCompletionRequest(body).convert(dr.ConversionOptions()).conversation)
    for reply in rendered:
        assert reply["token_ids"] == reply["tokens"] == reply["prompt_token_ids"] == reference
        assert reply["count"] == len(reference)
    async with http.post(cluster.urls["c1"] + "/v1/chat/completions", json=body) as resp:
        assert (await resp.json())["usage"]["prompt_tokens"] == len(reference)


# --- a client that leaves mid-body --------------------------------------------------------------


@pytest.fixture
def worker_process(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A sim worker process whose stdout and stderr (its logs) go to a file."""
    port = free_port()
    log = tmp_path / "worker.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(CLI + ["worker", "--engine", "sim", "--port", str(port), "--time-scale", "1000"],
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for_port(port, timeout=30)
        yield f"http://127.0.0.1:{port}", log
    finally:
        proc.terminate()
        proc.wait(timeout=15)


def send_half_body_and_leave(port: int, path: str, body: bytes) -> None:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     f"content-length: {len(body)}\r\n\r\n".encode() + body[: len(body) // 2])
        time.sleep(0.2)  # the worker is now waiting inside the body read


async def test_client_leaving_mid_body_leaves_no_traceback(worker_process: tuple[str, Path]) -> None:
    url, log = worker_process
    port = int(url.rsplit(":", 1)[1])
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "word " * 20_000}]}).encode()
    client = AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    await client.chat.completions.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    for path in ("/v1/chat/completions/render", "/v1/completions/render", "/v1/chat/completions", "/tokenize",
                 "/generate", "/v1/completions"):
        await asyncio.to_thread(send_half_body_and_leave, port, path, body)
    await asyncio.sleep(0.5)  # let the worker notice every disconnect
    reply = await client.chat.completions.create(model=MODEL, max_tokens=3,
                                                 messages=[{"role": "user", "content": "hi"}])
    assert reply.usage is not None and reply.usage.completion_tokens == 3
    logged = log.read_text()
    assert "Traceback" not in logged and "Exception in ASGI application" not in logged, logged[-3000:]


async def test_max_completion_tokens_bounds_the_reply(url: str) -> None:
    client = AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    reply = await client.chat.completions.create(model=MODEL, max_completion_tokens=7, extra_body={"ignore_eos": True},
                                                 messages=[{"role": "user", "content": "hi"}])
    assert reply.usage is not None and reply.usage.completion_tokens == 7


async def test_min_tokens_is_honoured_and_a_bad_one_refused(url: str, http: aiohttp.ClientSession) -> None:
    """As the gateway does: a peer router's benchmark gets the same lengths (`bench --tool-calls`)."""
    body = {"model": MODEL, "max_tokens": 200, "messages": [{"role": "user", "content": "weather?"}], "tools": TOOLS,
            "tool_choice": "required", "reasoning_effort": "none"}
    async with http.post(url + "/v1/chat/completions", json=body) as resp:
        natural = await resp.json()
    async with http.post(url + "/v1/chat/completions", json={**body, "min_tokens": 120}) as resp:
        longer = await resp.json()
    assert natural["usage"]["completion_tokens"] < 120 <= longer["usage"]["completion_tokens"] <= 200
    (call,) = longer["choices"][0]["message"]["tool_calls"]  # still one whole call
    assert json.loads(call["function"]["arguments"])["city"].startswith("Paris")
    async with http.post(url + "/v1/chat/completions", json={**body, "min_tokens": 201}) as resp:
        assert resp.status == 400 and "min_tokens" in (await resp.json())["error"]["message"]
