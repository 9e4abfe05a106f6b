"""Access control through the live gateway with the real SDKs: 401, 403, 429 (+ Retry-After and
x-ratelimit-* headers), in each protocol's error format."""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import openai
import pytest

from harness.launch import Gateway, SimCluster
from tests.gateways import api_key

MODEL = "DeepSeek-V4.1-Flash"


@pytest.fixture(scope="module")
def secured(sim_cluster: SimCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    extra = (api_key("full", "sk-full", requests_per_minute=1000)
             + api_key("other-model", "sk-other", models=("some-other-model",))
             + api_key("tight", "sk-tight", requests_per_minute=2, tokens_per_minute=100000)
             + api_key("counter", "sk-counter", requests_per_minute=2))
    roles = [s.split(":") for s in sim_cluster.specs]
    gw = Gateway(tmp_path_factory.mktemp("access"),
                 [(u, r, h) for u, (r, h) in zip(sim_cluster.urls, roles, strict=True)],
                 extra_toml=extra)
    gw.wait_ready(len(roles))
    yield gw
    gw.stop()


def oai(gw: Gateway, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0, timeout=30)


def ant(gw: Gateway, key: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gw.url, api_key=key, max_retries=0, timeout=30)


MSG = [{"role": "user", "content": "hello"}]


def test_valid_key_is_served_with_ratelimit_headers(secured: Gateway) -> None:
    raw = oai(secured, "sk-full").chat.completions.with_raw_response.create(model=MODEL, messages=MSG, max_tokens=4)
    assert raw.parse().choices[0].message.content is not None
    assert raw.headers["x-ratelimit-limit-requests"] == "1000"
    assert int(raw.headers["x-ratelimit-remaining-requests"]) < 1000
    assert raw.headers["x-request-id"]
    msg = ant(secured, "sk-full").messages.create(model=MODEL, messages=MSG, max_tokens=4)
    assert msg.content


def test_unknown_key_is_401_in_both_formats(secured: Gateway) -> None:
    with pytest.raises(openai.AuthenticationError) as e:
        oai(secured, "sk-wrong").chat.completions.create(model=MODEL, messages=MSG, max_tokens=4)
    assert e.value.status_code == 401 and e.value.body["type"] == "authentication_error"
    with pytest.raises(anthropic.AuthenticationError) as a:
        ant(secured, "sk-wrong").messages.create(model=MODEL, messages=MSG, max_tokens=4)
    assert a.value.status_code == 401
    assert a.value.body["error"]["type"] == "authentication_error"


def test_model_outside_the_allow_list_is_403(secured: Gateway) -> None:
    with pytest.raises(openai.PermissionDeniedError) as e:
        oai(secured, "sk-other").chat.completions.create(model=MODEL, messages=MSG, max_tokens=4)
    assert e.value.status_code == 403
    with pytest.raises(anthropic.PermissionDeniedError) as a:
        ant(secured, "sk-other").messages.create(model=MODEL, messages=MSG, max_tokens=4)
    assert a.value.body["error"]["type"] == "permission_error"


def test_rate_limit_is_429_with_retry_after(secured: Gateway) -> None:
    client = oai(secured, "sk-tight")
    for _ in range(2):
        client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=4)
    with pytest.raises(openai.RateLimitError) as e:
        client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=4)
    headers = e.value.response.headers
    assert int(headers["retry-after"]) >= 1
    assert headers["x-ratelimit-limit-requests"] == "2"
    assert headers["x-ratelimit-remaining-requests"] == "0"
    assert headers["x-ratelimit-limit-tokens"] == "100000"
    with pytest.raises(anthropic.RateLimitError) as a:  # same key, the Anthropic way (x-api-key)
        ant(secured, "sk-tight").messages.create(model=MODEL, messages=MSG, max_tokens=4)
    assert a.value.body["error"]["type"] == "rate_limit_error"
    assert int(a.value.response.headers["retry-after"]) >= 1
    # Streaming requests are refused before the stream starts: a plain 429, not an SSE error.
    with pytest.raises(openai.RateLimitError):
        client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=4, stream=True)


def test_count_tokens_counts_against_the_request_limit(secured: Gateway) -> None:
    """count_tokens spends the key's requests like any other call: the third within a minute
    is a 429 in Anthropic's format, and the key's next generation request is refused too."""
    client = ant(secured, "sk-counter")
    for remaining in ("1", "0"):
        raw = client.messages.with_raw_response.count_tokens(model=MODEL, messages=MSG)
        assert raw.parse().input_tokens > 0
        assert raw.headers["x-ratelimit-limit-requests"] == "2"
        assert raw.headers["x-ratelimit-remaining-requests"] == remaining
    with pytest.raises(anthropic.RateLimitError) as e:
        client.messages.count_tokens(model=MODEL, messages=MSG)
    assert e.value.body["error"]["type"] == "rate_limit_error"
    assert int(e.value.response.headers["retry-after"]) >= 1
    with pytest.raises(anthropic.RateLimitError):
        client.messages.create(model=MODEL, messages=MSG, max_tokens=4)
