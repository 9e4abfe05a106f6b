"""Legacy Completions: `client.completions.create(prompt=...)` end to end, and the pure parts
(request checks, incremental decoding, stop-sequence hold-back at every split point)."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from deepinfer_gateway.recipe_bridge.completion_stream import TextCompletionProcessor
from deepinfer_gateway.recipe_bridge.completions import LegacyOptions
from deepinfer_gateway.recipe_bridge.detokenizer import TextDecoder, token_bytes
from deepinfer_gateway.recipe_bridge.tokenizer import load_tokenizer

MODEL = "DeepSeek-V4.1-Flash"


def test_text_prompt_non_streaming(openai_client: openai.OpenAI) -> None:
    out = openai_client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12)
    assert out.object == "text_completion" and out.id.startswith("cmpl-")
    assert out.choices[0].text and out.choices[0].finish_reason == "length"
    # No chat template: the prompt is the text's own tokens.
    assert out.usage.prompt_tokens == len(load_tokenizer().tokenizer.encode("Once upon a time"))
    assert out.usage.completion_tokens == 12 and out.usage.prompt_tokens_details.cached_tokens == 0


def test_token_id_prompt_streaming_with_usage(openai_client: openai.OpenAI) -> None:
    ids = load_tokenizer().tokenizer.encode("The quick brown fox")
    chunks = list(openai_client.completions.create(model=MODEL, prompt=ids, max_tokens=200, stream=True,
                                                   stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text and chunks[-2].choices[0].finish_reason == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == len(ids)
    whole = openai_client.completions.create(model=MODEL, prompt=ids, max_tokens=200)
    assert whole.choices[0].text == text


def test_cached_prompt_tokens(openai_client: openai.OpenAI) -> None:
    prompt = " ".join(f"line {i}: value {i * 31 % 1009}." for i in range(300))
    openai_client.completions.create(model=MODEL, prompt=prompt, max_tokens=4)
    for _ in range(3):
        again = openai_client.completions.create(model=MODEL, prompt=prompt + " more", max_tokens=4)
        if again.usage.prompt_tokens_details.cached_tokens:
            assert again.usage.prompt_tokens_details.cached_tokens >= 1024
            return
    raise AssertionError("a repeated prompt was never reported as cached")


def test_stop_and_logprobs(openai_client: openai.OpenAI) -> None:
    full = openai_client.completions.create(model=MODEL, prompt="Hi", max_tokens=200, logprobs=2, seed=1)
    text = full.choices[0].text
    lp = full.choices[0].logprobs
    assert "".join(lp.tokens) == text and len(lp.token_logprobs) == full.usage.completion_tokens
    assert all(len(top) == 2 for top in lp.top_logprobs) and lp.text_offset[0] == 0
    stop = text[20:25]
    cut = openai_client.completions.create(model=MODEL, prompt="Hi", max_tokens=200, seed=1, stop=stop)
    assert cut.choices[0].text == text[: text.index(stop)] and cut.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in openai_client.completions.create(
        model=MODEL, prompt="Hi", max_tokens=200, seed=1, stop=[stop, "zzz"], stream=True) if c.choices)
    assert streamed == cut.choices[0].text


@pytest.mark.parametrize(("extra", "needle"), [
    ({"n": 2}, "`n`"), ({"best_of": 3}, "best_of"), ({"echo": True}, "echo"), ({"suffix": "x"}, "suffix"),
    ({"prompt": ["a", "b"]}, "Batched"), ({"prompt": [[1], [2]]}, "Batched"), ({"prompt": ""}, "empty"),
    ({"prompt": [10**7]}, "vocabulary"), ({"prompt": 3}, "prompt"), ({"max_tokens": 10**9}, "131072"),
    ({"stop": ["a"] * 5}, "stop"),
    ({"temperature": 3}, "temperature"), ({"logprobs": 99}, "logprobs"),
])
def test_refused_requests_are_openai_400s(gateway, extra: dict[str, Any], needle: str) -> None:
    r = httpx.post(gateway.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", **extra})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and needle in error["message"]


def _processor(stop: tuple[str, ...]) -> TextCompletionProcessor:
    table = token_bytes(load_tokenizer().json_text)
    return TextCompletionProcessor(table, LegacyOptions(stop=stop), "cmpl-x", MODEL, 0, include_usage=False)


def _run(processor: TextCompletionProcessor, ids: list[int], split: int) -> tuple[str, str | None]:
    chunks = processor.tokens(ids[:split], None) + processor.tokens(ids[split:], None) + processor.finish("stop")
    choices = [c.data["choices"][0] for c in chunks]
    return "".join(c["text"] for c in choices), choices[-1]["finish_reason"]


def test_stop_sequences_at_every_split_point() -> None:
    text = "Alpha beta — gamma ✓ delta END epsilon"
    ids = load_tokenizer().tokenizer.encode(text)
    for split in range(len(ids) + 1):
        assert _run(_processor(("END",)), ids, split) == ("Alpha beta — gamma ✓ delta ", "stop")
        assert _run(_processor(("nope", "ENDX")), ids, split) == (text, "stop")


def test_decoder_holds_back_split_utf8() -> None:
    table = token_bytes(load_tokenizer().json_text)
    ids = load_tokenizer().tokenizer.encode("日本語 ✓ émoji 🎉")
    decoder = TextDecoder(table)
    parts = [decoder.decode([t]) for t in ids] + [decoder.flush()]
    assert "".join(parts) == "日本語 ✓ émoji 🎉"
    assert all("\ufffd" not in p for p in parts)
