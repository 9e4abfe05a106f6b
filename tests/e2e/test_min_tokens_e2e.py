"""`min_tokens` through the real gateway: honoured by sim workers, refused by DeepInfer workers."""

from __future__ import annotations

import openai
import pytest

from harness.launch import Gateway


def _chat(gateway: Gateway, **extra: object) -> openai.types.chat.ChatCompletion:
    with openai.OpenAI(base_url=gateway.url + "/v1", api_key="test", max_retries=0, timeout=60) as client:
        return client.chat.completions.create(model="deepseek-chat", max_tokens=400,
                                              messages=[{"role": "user", "content": "Say hello."}],
                                              extra_body=extra or None)


def test_sim_workers_answer_at_least_min_tokens(sim_gateway: Gateway) -> None:
    natural = _chat(sim_gateway)
    assert natural.usage is not None and natural.choices[0].finish_reason == "stop"
    longer = _chat(sim_gateway, min_tokens=natural.usage.completion_tokens + 100)
    assert longer.usage is not None and longer.choices[0].finish_reason == "stop"
    assert longer.usage.completion_tokens >= natural.usage.completion_tokens + 100


def test_deepinfer_workers_refuse_min_tokens(deepinfer_gateway: Gateway) -> None:
    with pytest.raises(openai.BadRequestError, match="min_tokens"):
        _chat(deepinfer_gateway, min_tokens=5)
    assert _chat(deepinfer_gateway, min_tokens=0).choices[0].finish_reason in ("stop", "length")
