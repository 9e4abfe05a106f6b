"""Nothing accepted and ignored: every top-level field is honoured or refused with a 400 naming it."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from deepinfer_gateway.core.errors import BridgeError
from deepinfer_gateway.recipe_bridge.encoder import PromptEncoder
from deepinfer_gateway.recipe_bridge.fields import FIELDS, Refuse, check_fields, session_of
from deepinfer_gateway.recipe_bridge.prepare import ApiProtocol, BridgeConfig, RequestPreparer
from deepinfer_gateway.recipe_bridge.tokenizer import load_tokenizer

MODEL = "DeepSeek-V4.1-Flash"
BASE: dict[ApiProtocol, dict[str, Any]] = {
    ApiProtocol.CHAT: {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
    ApiProtocol.RESPONSES: {"model": MODEL, "input": "hi"},
    ApiProtocol.MESSAGES: {"model": MODEL, "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]},
    ApiProtocol.COMPLETIONS: {"model": MODEL, "prompt": "hi"},
}
# A value each refusal rule refuses, and one it accepts (its no-op).
REFUSED_AND_ACCEPTED: dict[str, tuple[Any, Any]] = {
    "presence_penalty": (0.5, 0), "frequency_penalty": (-1.0, 0.0), "repetition_penalty": (1.2, 1.0),
    "min_p": (0.05, 0), "logit_bias": ({"12": 5}, {}), "parallel_tool_calls": (False, True),
    "service_tier": ("scale", "auto"), "store": (True, False), "modalities": (["text", "audio"], ["text"]),
    "audio": ({"voice": "alloy", "format": "mp3"}, None), "prediction": ({"type": "content", "content": "x"}, None),
    "web_search_options": ({}, None), "verbosity": ("low", "medium"), "functions": ([{"name": "f"}], None),
    "function_call": ("auto", None), "truncation": ("auto", "disabled"),
    "max_tool_calls": (3, None), "prompt": ({"id": "p"}, None),
    "stream_options": ({"include_obfuscation": True}, {"include_obfuscation": False}),
    "container": ("c", None), "mcp_servers": ([{"type": "url"}], []), "context_management": ({}, None),
}
RULES = [(protocol, name) for protocol, table in FIELDS.items() for name, rule in table.items()
         if isinstance(rule, Refuse)]


@pytest.fixture(scope="module")
def preparer() -> RequestPreparer:
    return RequestPreparer(PromptEncoder(load_tokenizer()), BridgeConfig(model_names=(MODEL,)))


@pytest.mark.parametrize("protocol", list(BASE))
def test_an_unknown_field_is_a_400_naming_it(preparer: RequestPreparer, protocol: ApiProtocol) -> None:
    with pytest.raises(BridgeError) as refused:
        preparer.prepare(protocol, orjson.dumps({**BASE[protocol], "frobnicate": 1}))
    assert refused.value.status_code == 400 and refused.value.param == "frobnicate"
    assert "frobnicate" in refused.value.message


@pytest.mark.parametrize(("protocol", "name"), RULES)
def test_a_refused_field_passes_only_at_its_no_op_value(protocol: ApiProtocol, name: str) -> None:
    refused, accepted = REFUSED_AND_ACCEPTED[name]
    check_fields(protocol, {name: accepted})
    with pytest.raises(BridgeError) as error:
        check_fields(protocol, {name: refused})
    assert error.value.status_code == 400 and error.value.param == name


def test_every_refusal_rule_has_a_case() -> None:
    assert {name for _, name in RULES} == set(REFUSED_AND_ACCEPTED)


@pytest.mark.parametrize("protocol", [ApiProtocol.CHAT, ApiProtocol.MESSAGES, ApiProtocol.COMPLETIONS])
def test_top_k_is_honoured(preparer: RequestPreparer, protocol: ApiProtocol) -> None:
    assert preparer.prepare(protocol, orjson.dumps({**BASE[protocol], "top_k": 20})).sampling.top_k == 20
    assert preparer.prepare(protocol, orjson.dumps(BASE[protocol])).sampling.top_k == -1
    with pytest.raises(BridgeError):
        preparer.prepare(protocol, orjson.dumps({**BASE[protocol], "top_k": "20"}))


def test_completions_refuse_penalties(preparer: RequestPreparer) -> None:
    with pytest.raises(BridgeError) as refused:
        preparer.prepare(ApiProtocol.COMPLETIONS, orjson.dumps({**BASE[ApiProtocol.COMPLETIONS],
                                                                "presence_penalty": 0.3}))
    assert refused.value.param == "presence_penalty"
    preparer.prepare(ApiProtocol.COMPLETIONS, orjson.dumps({**BASE[ApiProtocol.COMPLETIONS], "presence_penalty": 0}))


def test_the_session_comes_from_user_prompt_cache_key_or_anthropic_metadata(preparer: RequestPreparer) -> None:
    assert session_of(ApiProtocol.CHAT, {"user": "u", "prompt_cache_key": "k"}) == "u"
    assert session_of(ApiProtocol.RESPONSES, {"prompt_cache_key": "k"}) == "k"
    assert session_of(ApiProtocol.MESSAGES, {"metadata": {"user_id": "a"}}) == "a"
    assert session_of(ApiProtocol.CHAT, {"metadata": {"user_id": "a"}}) is None
    prepared = preparer.prepare(ApiProtocol.CHAT, orjson.dumps({**BASE[ApiProtocol.CHAT], "prompt_cache_key": "k"}))
    assert prepared.user == "k"


@pytest.mark.parametrize("name", ["frobnicate", "max_tokens", "stream", "temperature"])
def test_count_tokens_refuses_a_field_it_does_not_read(preparer: RequestPreparer, name: str) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    assert preparer.count_tokens(orjson.dumps(body)).input_tokens > 0
    with pytest.raises(BridgeError) as refused:
        preparer.count_tokens(orjson.dumps({**body, name: 1}))
    assert refused.value.status_code == 400 and refused.value.param == name
