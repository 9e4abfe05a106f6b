"""One engine step's `tokens` event in, one protocol chunk out, and the answer exact whatever
the steps' sizes: the same output tokens pushed in groups of 1, 4 or any mix give the same
text, reasoning, tool calls, logprobs, finish and usage in every protocol, streamed or not
(stop sequences included: the usage counts up to the token that completed the match)."""

from __future__ import annotations

import functools
import re
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer_gateway.recipe_bridge.detokenizer import token_bytes
from deepinfer_gateway.recipe_bridge.encoder import PromptEncoder
from deepinfer_gateway.recipe_bridge.prepare import ApiProtocol, BridgeConfig, RequestPreparer
from deepinfer_gateway.recipe_bridge.stream import AnyResponseStream, response_stream
from deepinfer_gateway.recipe_bridge.tokenizer import TokenizerBundle, load_tokenizer
from deepinfer_gateway.workers.sim.output import CALLS_OPEN, DSML, dsml_invoke, fake_logprobs

MODEL = "DeepSeek-V4.1-Flash"
PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
              "required": ["city", "days"]}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": PARAMETERS}}
REASONING = "The user greets me. I will answer briefly, in one sentence.</think>"
ANSWER = "Hello there, my good friend! How are you today? 你好，朋友。 1234567 ok."
TOOL_TEXT = f"Let me look it up.</think>\n\n{CALLS_OPEN}{dsml_invoke(TOOL)}</{DSML} calls>"


def _chat(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 500, **extra}


# (protocol, request body, model output, finish reason)
CASES: dict[str, tuple[ApiProtocol, dict[str, Any], str, str]] = {
    "chat": (ApiProtocol.CHAT, _chat(), REASONING + ANSWER, "stop"),
    "chat-length": (ApiProtocol.CHAT, _chat(), REASONING + ANSWER, "length"),
    "chat-stop": (ApiProtocol.CHAT, _chat(stop=["friend", "zzz"]), REASONING + ANSWER, "stop"),
    "chat-stop-in-reasoning-only": (ApiProtocol.CHAT, _chat(stop=["greets"]), REASONING + ANSWER, "stop"),
    "chat-logprobs": (ApiProtocol.CHAT, _chat(logprobs=True, top_logprobs=2), REASONING + ANSWER, "stop"),
    "chat-tools": (ApiProtocol.CHAT, _chat(tools=[TOOL]), TOOL_TEXT, "stop"),
    "responses": (ApiProtocol.RESPONSES, {"model": MODEL, "input": "hi", "max_output_tokens": 500},
                  REASONING + ANSWER, "stop"),
    "responses-tools": (ApiProtocol.RESPONSES, {"model": MODEL, "input": "hi", "tools": [
        {"type": "function", "name": "get_weather", "parameters": PARAMETERS}]}, TOOL_TEXT, "stop"),
    "messages": (ApiProtocol.MESSAGES, {"model": MODEL, "max_tokens": 500, "messages": [
        {"role": "user", "content": "hi"}], "thinking": {"type": "enabled", "budget_tokens": 1024}},
                 REASONING + ANSWER, "stop"),
    "messages-stop": (ApiProtocol.MESSAGES, {"model": MODEL, "max_tokens": 500, "messages": [
        {"role": "user", "content": "hi"}], "stop_sequences": ["good fr"]}, "</think>" + ANSWER, "stop"),
    "messages-tools": (ApiProtocol.MESSAGES, {"model": MODEL, "max_tokens": 500, "messages": [
        {"role": "user", "content": "hi"}], "tools": [{"name": "get_weather", "input_schema": PARAMETERS}]},
                       TOOL_TEXT, "stop"),
    "completions": (ApiProtocol.COMPLETIONS, {"model": MODEL, "prompt": "hi", "max_tokens": 500},
                    ANSWER, "length"),
    "completions-stop": (ApiProtocol.COMPLETIONS, {"model": MODEL, "prompt": "hi", "max_tokens": 500,
                                                   "stop": ["朋友", "!"]}, ANSWER, "stop"),
    "completions-logprobs": (ApiProtocol.COMPLETIONS, {"model": MODEL, "prompt": "hi", "max_tokens": 500,
                                                       "logprobs": 2}, ANSWER, "stop"),
}


@pytest.fixture(scope="module")
def bundle() -> TokenizerBundle:
    return load_tokenizer(None)


@pytest.fixture(scope="module")
def preparer(bundle: TokenizerBundle) -> RequestPreparer:
    return RequestPreparer(PromptEncoder(bundle), BridgeConfig())


def groups(ids: list[int], sizes: list[int]) -> list[list[int]]:
    """`ids` cut into steps of `sizes` (cycled), as an engine's `tokens` events."""
    out, i, k = [], 0, 0
    while i < len(ids):
        n = sizes[k % len(sizes)]
        out.append(ids[i:i + n])
        i, k = i + n, k + 1
    return out


def play(preparer: RequestPreparer, bundle: TokenizerBundle, case: str, sizes: list[int], *,
         stream: bool) -> tuple[AnyResponseStream, list[bytes]]:
    """The case's output through a response stream in steps of `sizes`: the stream and the
    bytes each event produced (ready, one per step pushed, finish)."""
    protocol, body, text, reason = CASES[case]
    body = {**body, "stream": stream}
    if stream and protocol in (ApiProtocol.CHAT, ApiProtocol.COMPLETIONS):
        body["stream_options"] = {"include_usage": True}
    prepared = preparer.prepare(protocol, orjson.dumps(body))
    prepared.created = 1_700_000_000
    response = response_stream(prepared, bundle, "id-1")
    wants_lp = bool(body.get("logprobs"))
    outs = [response.ready(40, 8)]
    for step in groups(bundle.tokenizer.encode(text), sizes):
        outs.append(response.tokens(step, fake_logprobs(step, 3) if wants_lp else None))
        if response.done:
            break
    outs.append(response.finish(reason))
    return response, outs


TOOL_CALL_ID = re.compile(rb'"(call|toolu|fc)_[A-Za-z0-9_]+"')
CREATED = re.compile(rb'"(created_at|created)":\d+')


def unrandom(raw: bytes) -> bytes:
    """Tool call ids are random per request and creation times move with the clock (two plays
    can straddle a second): one placeholder for each."""
    return CREATED.sub(rb'"\1":0', TOOL_CALL_ID.sub(b'"call_X"', raw))


def frames(raw: bytes) -> list[dict[str, Any]]:
    return [orjson.loads(line[6:]) for line in unrandom(raw).split(b"\n")
            if line.startswith(b"data: ") and line != b"data: [DONE]"]


def semantic(protocol: ApiProtocol, raw: bytes) -> dict[str, Any]:
    """What a client makes of a stream: the texts by kind, tool calls, finish and usage."""
    text: dict[str, str] = {}
    rest: list[Any] = []
    logprobs: dict[str, list[Any]] = {}
    for f in frames(raw):
        if protocol in (ApiProtocol.CHAT, ApiProtocol.COMPLETIONS):
            if f.get("usage"):
                rest.append(("usage", f["usage"]))
            for c in f["choices"]:
                delta = c.get("delta", {"text": c.get("text")})
                for key, value in delta.items():
                    if isinstance(value, str):
                        text[key] = text.get(key, "") + value
                    elif key == "tool_calls" and value:
                        for call in value:  # arguments stream in pieces: joined per call
                            name = f"call{call['index']}"
                            text[name] = text.get(name, "") + call["function"].get("arguments", "")
                            rest.extend((k, v) for k, v in call.items() if k not in ("function", "index"))
                            rest.extend((k, v) for k, v in call["function"].items() if k != "arguments")
                    elif value:
                        rest.append((key, value))
                lp = c.get("logprobs") or {}
                for key, value in lp.items():  # per-token entries, whatever the chunking
                    if isinstance(value, list):
                        logprobs.setdefault(key, []).extend(value)
                if c.get("finish_reason"):
                    rest.append(("finish", c["finish_reason"]))
        else:
            kind = f.get("type", "")
            delta = f.get("delta")
            if isinstance(delta, str):
                key = kind.removesuffix(".delta")
                text[key] = text.get(key, "") + delta
            elif isinstance(delta, dict):
                for key, value in delta.items():
                    if key != "type" and isinstance(value, str) and "delta" in str(delta.get("type", "")):
                        text[key] = text.get(key, "") + value
                    elif key != "type":
                        rest.append((key, value))
            elif not kind.endswith(".delta"):
                rest.append(orjson.dumps({k: v for k, v in f.items() if k != "sequence_number"}).decode())
            if "usage" in f:
                rest.append(("usage", f["usage"]))
    return {"text": text, "rest": rest, "logprobs": logprobs}


STEP_SIZES = ([1], [4], [2, 3], [4, 1, 3, 2, 4, 4, 1])


@pytest.mark.parametrize("case", sorted(CASES))
def test_answer_is_the_same_whatever_the_steps(preparer: RequestPreparer, bundle: TokenizerBundle,
                                               case: str) -> None:
    protocol = CASES[case][0]
    one_by_one, raw1 = play(preparer, bundle, case, [1], stream=True)
    body1 = play(preparer, bundle, case, [1], stream=False)[0].body()
    seen = semantic(protocol, b"".join(raw1))
    assert seen["text"] and seen["rest"]  # the comparison below has something to compare
    for sizes in STEP_SIZES[1:]:
        response, raw = play(preparer, bundle, case, sizes, stream=True)
        assert semantic(protocol, b"".join(raw)) == seen, sizes
        assert response.completion_tokens == one_by_one.completion_tokens, sizes
        assert unrandom(play(preparer, bundle, case, sizes, stream=False)[0].body()) == unrandom(body1), sizes


@pytest.mark.parametrize("case", ["chat", "completions", "messages", "chat-logprobs", "completions-logprobs"])
def test_one_event_is_one_chunk(preparer: RequestPreparer, bundle: TokenizerBundle, case: str) -> None:
    """Inside the answer text, every step of 4 tokens comes out as exactly one SSE frame."""
    _, raw = play(preparer, bundle, case, [4], stream=True)
    steps = raw[1:-1]
    answer_steps = steps[len(steps) // 2:-1]  # well past the reasoning's end, before the last step
    assert answer_steps and all(out.count(b"data: ") == 1 for out in answer_steps)


@pytest.mark.parametrize(("case", "tokens"), [("chat-stop", "friend"), ("completions-stop", "!"),
                                              ("messages-stop", "good fr")])
def test_stop_sequence_counts_tokens_up_to_the_match(preparer: RequestPreparer, bundle: TokenizerBundle,
                                                     case: str, tokens: str) -> None:
    protocol, _, text, _ = CASES[case]
    ids = bundle.tokenizer.encode(text)
    response, raw = play(preparer, bundle, case, [4], stream=True)
    # The tokens up to the first one whose text completes the stop sequence.
    decode = token_bytes(bundle.json_text).decode
    upto = next(n for n in range(1, len(ids) + 1) if tokens in decode(ids[:n]))
    assert response.completion_tokens == upto < len(ids)
    usage = [f for f in frames(b"".join(raw)) if f.get("usage") or f.get("type") == "message_delta"][-1]["usage"]
    assert usage.get("completion_tokens", usage.get("output_tokens")) == upto


@functools.cache
def shared() -> tuple[RequestPreparer, TokenizerBundle]:
    """Module fixtures' equivalents for hypothesis (a failure report then names no huge repr)."""
    bundle = load_tokenizer(None)
    return RequestPreparer(PromptEncoder(bundle), BridgeConfig()), bundle


@settings(max_examples=25, deadline=None)
@given(sizes=st.lists(st.integers(min_value=1, max_value=6), min_size=1, max_size=12),
       case=st.sampled_from(["chat-stop", "chat-tools", "completions-stop", "messages-stop", "chat-logprobs"]))
def test_any_step_sizes(sizes: list[int], case: str) -> None:
    preparer, bundle = shared()
    protocol = CASES[case][0]
    reference = semantic(protocol, b"".join(play(preparer, bundle, case, [1], stream=True)[1]))
    assert semantic(protocol, b"".join(play(preparer, bundle, case, sizes, stream=True)[1])) == reference
