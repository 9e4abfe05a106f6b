"""Prefix-cache isolation between tenants, through the real openai SDK -> gateway -> sim worker.

Without a salt, `cached_tokens` tells any caller whether its guess of another tenant's prompt
is cached. A client's `cache_salt` (vLLM's field) or a key's `cache_isolation` gives the
request blocks no request of another salt shares, in the router's index and in the worker's
prefix cache. One worker, so every request lands where the first one was cached."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from harness.launch import Gateway
from tests.gateways import api_key, one_worker_gateway

MODEL = "DeepSeek-V4.1-Flash"
KEYS = (api_key("alice", "sk-alice") + api_key("mallory", "sk-mallory")
        + api_key("iso-1", "sk-iso-1", tenant="acme", cache_isolation=True)
        + api_key("iso-2", "sk-iso-2", tenant="acme", cache_isolation=True))


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    with one_worker_gateway(tmp_path_factory.mktemp("salt"), KEYS) as gw:
        yield gw


def _client(gw: Gateway, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0, timeout=60)


def _secret_prompt() -> str:
    """A system prompt of ~30 KV blocks, new per test (nothing of it is cached yet)."""
    tag = uuid.uuid4().hex
    return " ".join(f"{tag} rule {i}: answer with care {i * 7 % 1000}." for i in range(400))


def _chat_cached(client: openai.OpenAI, system: str, **extra: Any) -> int:
    reply = client.chat.completions.create(
        model=MODEL, max_tokens=4, extra_body=extra or None,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": uuid.uuid4().hex}])
    assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
    return reply.usage.prompt_tokens_details.cached_tokens or 0


def test_unsalted_prompts_are_an_oracle_across_keys(gateway: Gateway) -> None:
    """The attack the salt closes: another key's guess of the prompt reports it cached."""
    system = _secret_prompt()
    _chat_cached(_client(gateway, "sk-alice"), system)
    assert _chat_cached(_client(gateway, "sk-mallory"), system) > 3000


def test_a_different_client_salt_shares_nothing_and_the_same_salt_shares(gateway: Gateway) -> None:
    alice, mallory = _client(gateway, "sk-alice"), _client(gateway, "sk-mallory")
    system = _secret_prompt()
    assert _chat_cached(alice, system, cache_salt="alice-secret") == 0
    assert _chat_cached(alice, system, cache_salt="alice-secret") > 3000  # her own prefix still hits
    assert _chat_cached(mallory, system, cache_salt="mallory") == 0
    assert _chat_cached(mallory, system) == 0  # unsalted: alice's salted blocks are not its blocks either
    assert _chat_cached(mallory, system, cache_salt="alice-secret") > 3000  # one salt, one cache: by design


def test_completions_and_responses_honour_cache_salt(gateway: Gateway) -> None:
    alice, mallory = _client(gateway, "sk-alice"), _client(gateway, "sk-mallory")
    prompt = _secret_prompt()
    alice.completions.create(model=MODEL, prompt=prompt, max_tokens=4, extra_body={"cache_salt": "a"})
    other = mallory.completions.create(model=MODEL, prompt=prompt, max_tokens=4, extra_body={"cache_salt": "m"})
    assert other.usage is not None and (other.usage.prompt_tokens_details is None
                                        or not other.usage.prompt_tokens_details.cached_tokens)
    same = mallory.completions.create(model=MODEL, prompt=prompt, max_tokens=4, extra_body={"cache_salt": "a"})
    assert same.usage is not None and same.usage.prompt_tokens_details is not None
    assert (same.usage.prompt_tokens_details.cached_tokens or 0) > 3000
    instructions = _secret_prompt()
    alice.responses.create(model=MODEL, instructions=instructions, input="hi", max_output_tokens=16, store=False,
                           extra_body={"cache_salt": "a"})
    guessed = mallory.responses.create(model=MODEL, instructions=instructions, input="hi", max_output_tokens=16,
                                       store=False, extra_body={"cache_salt": "m"})
    assert guessed.usage is not None and guessed.usage.input_tokens_details.cached_tokens == 0
    shared = mallory.responses.create(model=MODEL, instructions=instructions, input="hi", max_output_tokens=16,
                                      store=False, extra_body={"cache_salt": "a"})
    assert shared.usage is not None and shared.usage.input_tokens_details.cached_tokens > 3000


def test_key_isolation_salts_every_request_of_its_tenant(gateway: Gateway) -> None:
    iso_1, iso_2 = _client(gateway, "sk-iso-1"), _client(gateway, "sk-iso-2")
    mallory = _client(gateway, "sk-mallory")
    system = _secret_prompt()
    assert _chat_cached(iso_1, system) == 0
    assert _chat_cached(iso_2, system) > 3000  # the same tenant's other key shares its cache
    assert _chat_cached(mallory, system) == 0
    for guess in ("acme", "tenant:acme", '["tenant:acme", null]'):  # no client salt stands in for the isolation
        assert _chat_cached(mallory, system, cache_salt=guess) == 0
    salted = _secret_prompt()  # a client salt inside an isolated tenant: both apply
    _chat_cached(iso_1, salted, cache_salt="x")
    assert _chat_cached(mallory, salted, cache_salt="x") == 0
    assert _chat_cached(iso_2, salted, cache_salt="x") > 3000


@pytest.mark.parametrize("salt", ["", 7, ["a"], "s" * 257])
def test_a_bad_cache_salt_is_refused(gateway: Gateway, salt: object) -> None:
    with pytest.raises(openai.BadRequestError) as chat:
        _client(gateway, "sk-alice").chat.completions.create(
            model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "hi"}], extra_body={"cache_salt": salt})
    body = chat.value.body
    assert isinstance(body, dict) and body.get("param") == "cache_salt"
    with pytest.raises(openai.BadRequestError) as legacy:
        _client(gateway, "sk-alice").completions.create(model=MODEL, prompt="hi", max_tokens=4,
                                                        extra_body={"cache_salt": salt})
    assert "cache_salt" in str(legacy.value)
