"""The final cached count a worker's `finish` brings (vLLM reports it only at the end) reaches
every usage the client sees at the end, in every protocol, streamed or not; a `finish`
without one changes nothing."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from deepinfer_gateway.recipe_bridge.encoder import PromptEncoder
from deepinfer_gateway.recipe_bridge.prepare import ApiProtocol, BridgeConfig, RequestPreparer
from deepinfer_gateway.recipe_bridge.stream import response_stream
from deepinfer_gateway.recipe_bridge.tokenizer import TokenizerBundle, load_tokenizer

PROMPT = 300
FINAL = 256
MODEL = "DeepSeek-V4.1-Flash"

BODIES: dict[ApiProtocol, dict[str, Any]] = {
    ApiProtocol.CHAT: {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8},
    ApiProtocol.RESPONSES: {"model": MODEL, "input": "hi", "max_output_tokens": 8},
    ApiProtocol.MESSAGES: {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8},
    ApiProtocol.COMPLETIONS: {"model": MODEL, "prompt": "hi", "max_tokens": 8},
}


@pytest.fixture(scope="module")
def bundle() -> TokenizerBundle:
    return load_tokenizer(None)


@pytest.fixture(scope="module")
def preparer(bundle: TokenizerBundle) -> RequestPreparer:
    return RequestPreparer(PromptEncoder(bundle), BridgeConfig())


def run(preparer: RequestPreparer, bundle: TokenizerBundle, protocol: ApiProtocol, *, stream: bool,
        include_usage: bool = True, ready_cached: int = 0, final: int | None = FINAL) -> bytes:
    body = {**BODIES[protocol], "stream": stream}
    if stream and include_usage and protocol in (ApiProtocol.CHAT, ApiProtocol.COMPLETIONS):
        body["stream_options"] = {"include_usage": True}
    response = response_stream(preparer.prepare(protocol, orjson.dumps(body)), bundle, "id-1")
    out = response.ready(PROMPT, ready_cached)
    out += response.tokens(bundle.tokenizer.encode("Hello there, friend."))
    out += response.finish("stop", final)
    return out if stream else response.body()


def sse_data(raw: bytes) -> list[dict[str, Any]]:
    frames = []
    for frame in raw.decode().split("\n\n"):
        for line in frame.splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                frames.append(orjson.loads(line[6:]))
    return frames


def cached_in(protocol: ApiProtocol, usage: dict[str, Any]) -> int:
    """The cached count a client reads from `usage`, checked against the prompt count it implies."""
    if protocol is ApiProtocol.MESSAGES:
        assert usage["input_tokens"] + usage["cache_read_input_tokens"] == PROMPT
        return int(usage["cache_read_input_tokens"])
    if protocol is ApiProtocol.RESPONSES:
        assert usage["input_tokens"] == PROMPT
        return int(usage["input_tokens_details"]["cached_tokens"])
    assert usage["prompt_tokens"] == PROMPT
    assert usage["prompt_cache_hit_tokens"] + usage["prompt_cache_miss_tokens"] == PROMPT
    assert usage["prompt_cache_hit_tokens"] == usage["prompt_tokens_details"]["cached_tokens"]
    return int(usage["prompt_tokens_details"]["cached_tokens"])


def final_usage(protocol: ApiProtocol, raw: bytes, stream: bool) -> dict[str, Any]:
    if not stream:
        return orjson.loads(raw)["usage"]
    frames = sse_data(raw)
    if protocol is ApiProtocol.RESPONSES:
        return next(f["response"]["usage"] for f in frames if f["type"] == "response.completed")
    if protocol is ApiProtocol.MESSAGES:
        return next(f["usage"] for f in frames if f["type"] == "message_delta")
    with_usage = [f for f in frames if f.get("usage")]
    assert len(with_usage) == 1 and with_usage[0] is frames[-1]
    return with_usage[0]["usage"]


@pytest.mark.parametrize("stream", [False, True], ids=["body", "stream"])
@pytest.mark.parametrize("protocol", list(BODIES), ids=str)
def test_finish_count_replaces_the_provisional_one(preparer: RequestPreparer, bundle: TokenizerBundle,
                                                   protocol: ApiProtocol, stream: bool) -> None:
    raw = run(preparer, bundle, protocol, stream=stream)
    assert cached_in(protocol, final_usage(protocol, raw, stream)) == FINAL


@pytest.mark.parametrize("stream", [False, True], ids=["body", "stream"])
@pytest.mark.parametrize("protocol", list(BODIES), ids=str)
def test_finish_without_a_count_changes_nothing(preparer: RequestPreparer, bundle: TokenizerBundle,
                                                protocol: ApiProtocol, stream: bool) -> None:
    for ready_cached in (0, 128):
        raw = run(preparer, bundle, protocol, stream=stream, ready_cached=ready_cached, final=None)
        assert cached_in(protocol, final_usage(protocol, raw, stream)) == ready_cached
        same = run(preparer, bundle, protocol, stream=stream, ready_cached=ready_cached, final=ready_cached)
        assert same == raw or not stream  # a body's id/created may differ; streams are byte-identical


def test_anthropic_start_keeps_the_provisional_count(preparer: RequestPreparer, bundle: TokenizerBundle) -> None:
    frames = sse_data(run(preparer, bundle, ApiProtocol.MESSAGES, stream=True, ready_cached=128))
    start = next(f for f in frames if f["type"] == "message_start")["message"]["usage"]
    assert start["cache_read_input_tokens"] == 128  # sent before the worker knew: it stands
    delta = next(f for f in frames if f["type"] == "message_delta")["usage"]
    assert (delta["cache_read_input_tokens"], delta["input_tokens"]) == (FINAL, PROMPT - FINAL)


def test_legacy_completion_usage_on_its_last_chunk(preparer: RequestPreparer, bundle: TokenizerBundle) -> None:
    frames = sse_data(run(preparer, bundle, ApiProtocol.COMPLETIONS, stream=True, include_usage=False))
    assert frames[-1]["choices"][0]["finish_reason"] == "stop"
    assert cached_in(ApiProtocol.COMPLETIONS, frames[-1]["usage"]) == FINAL


def test_chat_stream_without_include_usage(preparer: RequestPreparer, bundle: TokenizerBundle) -> None:
    """deepseek-recipe puts the usage on the last chunk then (DeepSeek's API does): corrected too."""
    frames = sse_data(run(preparer, bundle, ApiProtocol.CHAT, stream=True, include_usage=False))
    assert frames[-1]["choices"] and frames[-1]["choices"][0]["finish_reason"] == "stop"
    assert cached_in(ApiProtocol.CHAT, frames[-1]["usage"]) == FINAL
