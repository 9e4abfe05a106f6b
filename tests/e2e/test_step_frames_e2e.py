"""End to end, one frame per engine step: the real openai SDK streams from the gateway's HTTP
front end, in front of a sim worker running DSpark-like steps (the bundled profile: nextn 3,
75% acceptance), slow enough (time scale 4) that each step is its own `tokens` event.

Each streamed chunk carries one step's tokens (counted by its logprobs: one entry per token),
~3.25 on average; and the streamed answer is exactly the non-streamed one: text, reasoning,
tool calls, usage, a max_tokens cut inside a step, a stop sequence inside one.
Also `LineStream.buffered` on a real connection (the relay's coalescing relies on it)."""

from __future__ import annotations

import asyncio
import json
import statistics
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web

from deepinfer_gateway.gateway.upstream.http import LineStream
from harness.launch import Gateway, SimCluster

MODEL = "DeepSeek-V4.1-Flash"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


# Worker protocol v1 (one HTTP stream per request) and v2 (one connection per worker, where
# the relay frames and writes each step in the connection reader's call: relay.py's direct path).
@pytest.fixture(scope="module", params=["v1", "auto"])
def client(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[openai.OpenAI]:
    cluster = SimCluster("unified:sm100", time_scale=4.0)
    try:
        gateway = Gateway(tmp_path_factory.mktemp("gw-frames"), [(cluster.urls[0], "unified", "sm100")],
                          extra_toml=f'worker_protocol = "{request.param}"\n')
        try:
            gateway.wait_ready(1)
            with openai.OpenAI(base_url=gateway.url + "/v1", api_key="t", max_retries=0, timeout=60) as c:
                yield c
        finally:
            gateway.stop()
    finally:
        cluster.stop()


def ask(client: openai.OpenAI, stream: bool, text: str = "Hello there", **kwargs: Any) -> Any:
    kwargs.setdefault("max_tokens", 2000)
    kwargs.setdefault("extra_body", {"thinking": {"type": "enabled"}, "ignore_eos": False})
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}],
                                          stream=stream, **kwargs)


def streamed(client: openai.OpenAI, text: str = "Hello there", **kwargs: Any) -> dict[str, Any]:
    """The stream as the client assembles it, and the tokens each chunk carried (from logprobs)."""
    out: dict[str, Any] = {"content": "", "reasoning": "", "tools": {}, "finish": None, "usage": None, "steps": []}
    for chunk in ask(client, True, text, stream_options={"include_usage": True}, **kwargs):
        if chunk.usage is not None:
            out["usage"] = chunk.usage.model_dump()
        for choice in chunk.choices:
            delta = choice.delta
            out["content"] += delta.content or ""
            out["reasoning"] += getattr(delta, "reasoning_content", None) or ""
            for call in delta.tool_calls or ():
                slot = out["tools"].setdefault(call.index, {"name": "", "arguments": ""})
                slot["name"] += call.function.name or ""
                slot["arguments"] += call.function.arguments or ""
            lp = choice.logprobs
            entries = (lp.content or []) + ((lp.model_extra or {}).get("reasoning_content") or []) if lp else []
            if entries:
                out["steps"].append(len(entries))
            out["finish"] = choice.finish_reason or out["finish"]
    return out


def answered(client: openai.OpenAI, text: str = "Hello there", **kwargs: Any) -> dict[str, Any]:
    r = ask(client, False, text, **kwargs)
    m = r.choices[0].message
    tools = {i: {"name": c.function.name, "arguments": c.function.arguments}
             for i, c in enumerate(m.tool_calls or ())}
    return {"content": m.content or "", "reasoning": (m.model_extra or {}).get("reasoning_content") or "",
            "tools": tools, "finish": r.choices[0].finish_reason, "usage": r.usage.model_dump()}


def same(s: dict[str, Any], a: dict[str, Any]) -> None:
    for key in ("content", "reasoning", "tools", "finish"):
        assert s[key] == a[key], key
    for key in ("prompt_tokens", "completion_tokens", "completion_tokens_details"):  # the cached count
        assert s["usage"][key] == a["usage"][key], key  # grows as the prefix cache warms: not compared


def test_each_chunk_carries_one_dspark_step(client: openai.OpenAI) -> None:
    s = streamed(client, "Tell me a long story", max_tokens=1500, logprobs=True,
                 extra_body={"thinking": {"type": "disabled"}, "ignore_eos": True})
    steps = s["steps"][1:-1]  # the first is the prefill's one token; the last may be cut by max_tokens
    assert sum(s["steps"]) == s["usage"]["completion_tokens"] == 1500
    assert set(steps) <= {1, 2, 3, 4} and len(steps) > 200
    assert 2.9 <= statistics.mean(steps) <= 3.6  # 1 + 3 x 0.75 = 3.25 per step


def test_answer_with_reasoning_is_the_non_streamed_one(client: openai.OpenAI) -> None:
    s, a = streamed(client), answered(client)
    assert s["reasoning"] and s["content"] and s["finish"] == "stop"
    same(s, a)


def test_max_tokens_cut_inside_a_step(client: openai.OpenAI) -> None:
    off = {"thinking": {"type": "disabled"}, "ignore_eos": True}  # with thinking, `</think>` has no logprob
    for n in (37, 38, 39, 40):  # whatever the cut's place in a step
        s = streamed(client, "Tell me a story", max_tokens=n, logprobs=True, extra_body=off)
        assert s["finish"] == "length" and s["usage"]["completion_tokens"] == sum(s["steps"]) == n
        same(s, answered(client, "Tell me a story", max_tokens=n, logprobs=True, extra_body=off))


def test_stop_sequence_inside_a_step(client: openai.OpenAI) -> None:
    off = {"thinking": {"type": "disabled"}}
    full = ask(client, False, logprobs=True, extra_body=off).choices[0]
    text = full.message.content
    tokens = [entry.token for entry in full.logprobs.content]
    for word in dict.fromkeys(text.split()[3:9]):  # stops at several places in their steps
        upto = next(n for n in range(len(tokens)) if word in "".join(tokens[:n]))  # the token completing it
        s = streamed(client, stop=[word], extra_body=off)
        assert s["finish"] == "stop" and s["content"] == text[:text.index(word)]
        assert s["usage"]["completion_tokens"] == upto < len(tokens), word
        same(s, answered(client, stop=[word], extra_body=off))


def test_tool_calls_are_the_non_streamed_ones(client: openai.OpenAI) -> None:
    s = streamed(client, "What is the weather in Paris?", tools=[WEATHER], tool_choice="auto")
    a = answered(client, "What is the weather in Paris?", tools=[WEATHER], tool_choice="auto")
    assert s["finish"] == "tool_calls" and json.loads(s["tools"][0]["arguments"]) == {"city": "Paris"}
    same(s, a)


async def test_line_stream_says_buffered_only_for_a_whole_line_received(tmp_path: Path) -> None:
    """On a real loopback connection: True for a line in hand, False while one is awaited or
    only part of it arrived; the relay writes to its client whenever it says False."""
    go = [asyncio.Event() for _ in range(2)]

    async def lines(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        await response.write(b'{"n": 1}\n{"n": 2}\n')
        await go[0].wait()
        await response.write(b'{"n": ')
        await go[1].wait()
        await response.write(b'3}\n')
        return response

    app = web.Application()
    app.router.add_get("/", lines)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        async with aiohttp.ClientSession() as session, session.get(f"http://127.0.0.1:{port}/") as response:
            stream = LineStream(response, 5.0, 5.0)
            assert await stream.read_line() == b'{"n": 1}\n'
            assert stream.buffered()
            assert await stream.read_line() == b'{"n": 2}\n'
            assert not stream.buffered()
            go[0].set()
            await asyncio.sleep(0.2)
            assert not stream.buffered()  # half a line
            go[1].set()
            for _ in range(50):
                await asyncio.sleep(0.02)
                if stream.buffered():
                    break
            assert stream.buffered()
            assert await stream.read_line() == b'{"n": 3}\n'
            stream.release()
    finally:
        await runner.cleanup()
