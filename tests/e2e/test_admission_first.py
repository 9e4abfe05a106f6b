"""Admission comes before preparation: a request refused by its key's allow-list, its slots in
flight or its rate limit is refused before its body is parsed and tokenized (no preprocessing
observed), and a body too large to fit the context is refused from its size alone. Real
gateway process, real openai SDK."""

from __future__ import annotations

import time
from collections.abc import Iterator

import openai
import pytest

from harness.launch import Gateway
from tests.fault_doubles import scrape, total
from tests.gateways import api_key, one_worker_gateway

pytestmark = pytest.mark.e2e

MODEL = "DeepSeek-V4.1-Flash"
CONTEXT = 2000


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    toml = (f"context_limit = {CONTEXT}\nmax_body_bytes = {64 * 1024 * 1024}\n"
            + api_key("limited", requests_per_minute=1) + api_key("narrow", models=[f"{MODEL}-other"])
            + api_key("one-at-a-time") + api_key("plain")
            + "[images]\nmax_images = 0\n[client_connections]\nmax_requests_per_key = 1\n")
    with one_worker_gateway(tmp_path_factory.mktemp("admission"), toml) as gw:
        yield gw


def _client(gateway: Gateway, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0, timeout=60)


def _chat(client: openai.OpenAI, content: str) -> object:
    return client.chat.completions.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": content}])


def _prepared(gateway: Gateway) -> float:
    return total(scrape(gateway.url), "dgw_preprocess_seconds_count")


HUGE = "word " * 200_000  # ~1 MB of text: far beyond the context, costly to tokenize


def test_a_key_over_its_rate_limit_is_refused_before_its_prompt_is_prepared(gateway: Gateway) -> None:
    with _client(gateway, "limited") as client:
        _chat(client, "the one request this minute")
        before = _prepared(gateway)
        with pytest.raises(openai.RateLimitError) as refused:
            _chat(client, HUGE)
    assert "Rate limit reached" in refused.value.message
    assert _prepared(gateway) == before  # refused before parsing and tokenizing, not with a 400 after


def test_a_model_outside_the_keys_allow_list_is_refused_before_preparing(gateway: Gateway) -> None:
    before = _prepared(gateway)
    with _client(gateway, "narrow") as client, pytest.raises(openai.PermissionDeniedError) as refused:
        _chat(client, HUGE)
    assert f"may not use model {MODEL}" in refused.value.message
    assert _prepared(gateway) == before


def test_a_key_at_its_requests_in_flight_cap_gets_429_until_one_ends(gateway: Gateway) -> None:
    with _client(gateway, "one-at-a-time") as client:
        stream = client.chat.completions.create(model=MODEL, max_tokens=1500, stream=True,
                                                messages=[{"role": "user", "content": "a long one"}],
                                                extra_body={"ignore_eos": True})
        with stream:
            next(iter(stream))  # the stream holds the key's one slot
            before = _prepared(gateway)
            with pytest.raises(openai.RateLimitError) as refused:
                _chat(client, "a second one meanwhile")
            assert "requests in flight" in refused.value.message
            assert _prepared(gateway) == before
            with _client(gateway, "plain") as other:  # another key is not held back
                assert _chat(other, "another key")
        # The stream closed (the client left): its slot is back.
        deadline = time.monotonic() + 10
        while True:
            try:
                assert _chat(client, "after the stream")
                break
            except openai.RateLimitError:
                assert time.monotonic() < deadline, "the stream's slot was never given back"
                time.sleep(0.05)


def test_a_body_too_large_to_fit_the_context_gets_413_before_it_is_read_whole(gateway: Gateway) -> None:
    before = _prepared(gateway)
    with _client(gateway, "plain") as client, pytest.raises(openai.APIStatusError) as refused:
        _chat(client, "x" * (CONTEXT * 128 * 6 + 2 * 1024 * 1024))
    assert refused.value.status_code == 413
    assert f"context of {CONTEXT} tokens" in refused.value.message
    assert _prepared(gateway) == before
