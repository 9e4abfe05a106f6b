"""Every top-level request field, per protocol: honoured, or refused with a 400 naming it.

deepseek-recipe reads the fields it knows and skips the rest, so a field it does not read
would be accepted and ignored. This table is the gateway's answer for each one:
- HONOURED: deepseek-recipe or the gateway acts on it (docs/api.md lists how);
- a `Refuse(...)` rule: refused unless its value is the no-op one (e.g. `presence_penalty: 0`),
  with the reason in the message;
- a field in no table: refused as unknown, as OpenAI and Anthropic do.
Fields that describe the caller (`metadata`, `safety_identifier`) are honoured in the sense
their APIs give them: they change nothing in the answer.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from deepinfer_gateway.core.errors import BridgeError
from deepinfer_gateway.recipe_bridge.prepared import ApiProtocol

HONOURED = None


@dataclass(frozen=True, slots=True)
class Refuse:
    """Refused unless `accepts(value)`; `why` completes the message."""

    accepts: Callable[[Any], bool]
    why: str


def _is(*values: Any) -> Callable[[Any], bool]:
    # `v is x` for booleans and None (so 0 does not pass for False), equality for the rest.
    def accepts(value: Any) -> bool:
        return any(value is v if v is None or isinstance(v, bool) else
                   (value == v and not isinstance(value, bool)) for v in values)
    return accepts


def _empty(value: Any) -> bool:
    return value is None or value == [] or value == {}


_SAMPLER = "DeepInfer's sampler has no such control"
_PENALTIES = {
    "presence_penalty": Refuse(_is(None, 0), f"{_SAMPLER}; only 0 is accepted"),
    "frequency_penalty": Refuse(_is(None, 0), f"{_SAMPLER}; only 0 is accepted"),
    "repetition_penalty": Refuse(_is(None, 1), f"{_SAMPLER}; only 1 is accepted"),
    "min_p": Refuse(_is(None, 0), f"{_SAMPLER}; only 0 is accepted"),
    "logit_bias": Refuse(_empty, f"{_SAMPLER}; only an empty map is accepted"),
}
# Honoured by flow control (gateway/serving/service_tier.py), which refuses flex and priority while it is off.
_TIER = Refuse(_is(None, "auto", "default", "flex", "priority"), "it is one of auto, default, flex, priority")
_PARALLEL = Refuse(_is(None, True), "the model may call several tools at once; false cannot be enforced")
_TOOL_FOLLOWUPS = "this gateway does not run hosted tools"

_COMMON: dict[str, Refuse | None] = {
    "model": HONOURED, "stream": HONOURED, "temperature": HONOURED, "top_p": HONOURED, "tools": HONOURED,
    "tool_choice": HONOURED, "metadata": HONOURED, "ignore_eos": HONOURED, "min_tokens": HONOURED,
}

FIELDS: dict[ApiProtocol, Mapping[str, Refuse | None]] = {
    ApiProtocol.CHAT: {
        **_COMMON, **_PENALTIES,
        "messages": HONOURED, "max_tokens": HONOURED, "max_completion_tokens": HONOURED, "stop": HONOURED,
        "seed": HONOURED, "logprobs": HONOURED, "top_logprobs": HONOURED, "response_format": HONOURED,
        "n": HONOURED, "user": HONOURED, "stream_options": HONOURED, "thinking": HONOURED,
        "reasoning_effort": HONOURED, "top_k": HONOURED, "safety_identifier": HONOURED,
        "prompt_cache_key": HONOURED,  # a session key: requests sharing it are kept on one worker
        "cache_salt": HONOURED,  # vLLM's: prefix-cache isolation (gateway/serving/cache_salt.py)
        "parallel_tool_calls": _PARALLEL,
        "service_tier": _TIER,
        "store": Refuse(_is(None, False), "chat completions are not stored; use the Responses API"),
        "modalities": Refuse(lambda v: v is None or v == ["text"], "the model answers in text only"),
        "audio": Refuse(_is(None), "the model answers in text only"),
        "prediction": Refuse(_is(None), "predicted outputs are not supported"),
        "web_search_options": Refuse(_is(None), _TOOL_FOLLOWUPS),
        "verbosity": Refuse(_is(None, "medium"), "the model has no verbosity control"),
        "functions": Refuse(_is(None), "the deprecated functions field is not supported; use tools"),
        "function_call": Refuse(_is(None), "the deprecated function_call field is not supported; use tool_choice"),
    },
    ApiProtocol.RESPONSES: {
        **_COMMON,
        "input": HONOURED, "instructions": HONOURED, "max_output_tokens": HONOURED, "text": HONOURED,
        "reasoning": HONOURED, "top_logprobs": HONOURED, "user": HONOURED, "safety_identifier": HONOURED,
        "prompt_cache_key": HONOURED, "cache_salt": HONOURED,
        # Stored Responses (gateway/serving/responses_api.py) answers or refuses these.
        "store": HONOURED, "previous_response_id": HONOURED, "background": HONOURED, "conversation": HONOURED,
        "include": HONOURED,  # each value honoured or refused by recipe_bridge/includes.py
        "parallel_tool_calls": _PARALLEL,
        "service_tier": _TIER,
        "truncation": Refuse(_is(None, "disabled"), "a prompt over the context limit is refused, not truncated"),
        "max_tool_calls": Refuse(_is(None), "the number of tool calls cannot be capped"),
        "prompt": Refuse(_is(None), "stored prompt templates are not supported"),
        "stream_options": Refuse(lambda v: v is None or v == {} or v == {"include_obfuscation": False},
                                 "stream obfuscation is not applied"),
    },
    ApiProtocol.MESSAGES: {
        **_COMMON,
        "messages": HONOURED, "max_tokens": HONOURED, "system": HONOURED, "stop_sequences": HONOURED,
        "thinking": HONOURED, "top_k": HONOURED,
        "service_tier": Refuse(_is(None, "auto", "standard_only"), "it is auto or standard_only"),
        "container": Refuse(_is(None), _TOOL_FOLLOWUPS),
        "mcp_servers": Refuse(_empty, _TOOL_FOLLOWUPS),
        "context_management": Refuse(_is(None), "context editing is not supported"),
    },
}


# Anthropic's `count_tokens` takes the prompt's fields of a Messages body only (as Anthropic:
# `max_tokens`, `stream` and the sampling fields are refused as unknown there).
COUNT_TOKENS_FIELDS: Mapping[str, Refuse | None] = {
    name: FIELDS[ApiProtocol.MESSAGES][name]
    for name in ("model", "messages", "system", "tools", "tool_choice", "thinking", "mcp_servers", "context_management")
}


def check_fields(protocol: ApiProtocol, body: Mapping[str, Any],
                 rules: Mapping[str, Refuse | None] | None = None) -> None:
    """400 for the first field `protocol` does not honour (unknown, or refused at that value);
    `rules`: another table than FIELDS[protocol] (COUNT_TOKENS_FIELDS)."""
    rules = FIELDS[protocol] if rules is None else rules
    for name, value in body.items():
        if name not in rules:
            raise BridgeError(400, f"Unrecognized request argument supplied: {name}", param=name)
        rule = rules[name]
        if rule is not None and not rule.accepts(value):
            raise BridgeError(400, f"{name}: {value!r} is not supported: {rule.why}.", param=name)


def top_k_of(value: Any) -> int:
    """`top_k`: -1 (off) when absent or 0, else a positive integer."""
    if value is None or value == 0 and not isinstance(value, bool):
        return -1
    if isinstance(value, bool) or not isinstance(value, int) or value < -1:
        raise BridgeError(400, "top_k must be a positive integer (0 or -1: off).", param="top_k")
    return value


CACHE_SALT_MAX_CHARS = 256


def cache_salt_of(value: Any) -> str | None:
    """`cache_salt` (vLLM's extension): None when absent, else a non-empty string."""
    if value is None:
        return None
    if not isinstance(value, str) or not 0 < len(value) <= CACHE_SALT_MAX_CHARS:
        raise BridgeError(400, f"cache_salt must be a non-empty string of at most {CACHE_SALT_MAX_CHARS} "
                               "characters.", param="cache_salt")
    return value


def session_of(protocol: ApiProtocol, body: Mapping[str, Any]) -> str | None:
    """The caller's session, for affinity: `user`, else `prompt_cache_key` (OpenAI's), else
    Anthropic's `metadata.user_id`."""
    for key in ("user", "prompt_cache_key"):
        value = body.get(key)
        if isinstance(value, str) and value:
            return value
    if protocol is ApiProtocol.MESSAGES:
        metadata = body.get("metadata")
        user = metadata.get("user_id") if isinstance(metadata, dict) else None
        return user if isinstance(user, str) and user else None
    return None
