"""Correct the prompt-cache figures in a response's final usage.

An engine that reports its cached prompt tokens only at the end (vLLM, docs/worker-protocol.md:
`finish.cached_tokens`) starts a response with a provisional count. Whatever reports usage at
the end, a non-streaming body or the last usage chunk or event of a stream, is rewritten here
with the real count. Only those final frames pass through: the per-token path never does.
"""

from __future__ import annotations

from typing import Any

import orjson

from deepinfer_gateway.recipe_bridge.prepare import ApiProtocol


def set_cached(protocol: ApiProtocol, usage: dict[str, Any], prompt_tokens: int, cached_tokens: int) -> None:
    """Rewrite `usage` (the protocol's shape, as deepseek-recipe writes it) in place."""
    if protocol is ApiProtocol.MESSAGES:  # Anthropic: input_tokens excludes cache reads
        usage["cache_read_input_tokens"] = cached_tokens
        usage["input_tokens"] = prompt_tokens - cached_tokens
    elif protocol is ApiProtocol.RESPONSES:
        usage["input_tokens_details"] = {**(usage.get("input_tokens_details") or {}), "cached_tokens": cached_tokens}
    else:  # chat and legacy completions: OpenAI's field plus DeepSeek's hit/miss pair
        usage["prompt_tokens_details"] = {**(usage.get("prompt_tokens_details") or {}),
                                          "cached_tokens": cached_tokens}
        usage["prompt_cache_hit_tokens"] = cached_tokens
        usage["prompt_cache_miss_tokens"] = prompt_tokens - cached_tokens


def usage_of(data: dict[str, Any]) -> dict[str, Any] | None:
    """The usage object of a response body, chunk or event: top level (bodies, chat chunks,
    Anthropic `message_delta`) or in a Responses event's `response` (`response.completed`)."""
    usage = data.get("usage")
    if isinstance(usage, dict):
        return usage
    response = data.get("response")
    if isinstance(response, dict) and isinstance(response.get("usage"), dict):
        usage = response["usage"]
        assert isinstance(usage, dict)
        return usage
    return None


def corrected(protocol: ApiProtocol, data: dict[str, Any], prompt_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """`data` with its usage (if it has one) carrying `cached_tokens`; changed in place."""
    usage = usage_of(data)
    if usage is not None:
        set_cached(protocol, usage, prompt_tokens, cached_tokens)
    return data


def corrected_json(protocol: ApiProtocol, text: str, prompt_tokens: int, cached_tokens: int) -> str:
    """`corrected` for a JSON text: parsed and written again only if it holds a usage."""
    if '"usage":' not in text:
        return text
    data = corrected(protocol, orjson.loads(text), prompt_tokens, cached_tokens)
    return orjson.dumps(data).decode()
