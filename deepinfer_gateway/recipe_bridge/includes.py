"""OpenAI's `include` (Responses create and retrieve, a response's input items, conversation
items): which values the gateway honours, the 400 naming any other, and what each honoured
value shows of a stored item.

- `message.output_text.logprobs`: on create, the tokens' log probabilities (with `top_logprobs`
  alternatives, 0-20) on each `output_text` part and each `response.output_text.delta` /
  `.done` event. A stored response and its conversation items keep them; a read (retrieve,
  input items, conversation items) shows them only when its own `include` asks.
- `message.input_image.image_url`: accepted, and always honoured: an input image is stored as
  sent (its URL or data URL) and every read shows its `image_url`. Hiding it by default would
  break clients that send listed items back as input (the Agents SDK's
  `OpenAIConversationsSession` lists without `include`, and an image without a URL is a 400).

Every other value is refused: the hosted tools' results (this gateway runs none) and
`reasoning.encrypted_content` (reasoning is not encrypted for the client to carry).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import orjson

from deepinfer_gateway.core.errors import BridgeError

LOGPROBS = "message.output_text.logprobs"
INPUT_IMAGE_URL = "message.input_image.image_url"
NONE: frozenset[str] = frozenset()

_HOSTED = "this gateway runs no hosted tools, so no such output exists"
_REFUSED = {
    "file_search_call.results": _HOSTED,
    "web_search_call.results": _HOSTED,
    "web_search_call.action.sources": _HOSTED,
    "code_interpreter_call.outputs": _HOSTED,
    "computer_call_output.output.image_url": _HOSTED,
    "reasoning.encrypted_content": "reasoning is not encrypted for the client to carry; keep the response stored "
                                   "(store: true) and continue it with previous_response_id or conversation",
}
HONOURED = (LOGPROBS, INPUT_IMAGE_URL)
# The stream events whose logprobs OpenAI types without `bytes` (the output_text part has them).
STREAM_TEXT_EVENTS = frozenset({"response.output_text.delta", "response.output_text.done"})


def includes_of(value: Any) -> frozenset[str]:
    """`include` (absent, or a list of includable values): the honoured values it names; a 400
    naming the first value that is refused or unknown."""
    if value is None:
        return NONE
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise BridgeError(400, "include must be a list of strings.", param="include")
    for name in value:
        if name in _REFUSED:
            raise BridgeError(400, f"include: '{name}' is not supported: {_REFUSED[name]}.", param="include")
        if name not in HONOURED:
            raise BridgeError(400, f"include: '{name}' is not an includable value; supported: "
                                   f"{', '.join(HONOURED)}.", param="include")
    return frozenset(value)


def logprobs_asked(includes: frozenset[str], top_logprobs: int | None) -> tuple[bool, int]:
    """Responses create: (whether the tokens' logprobs are asked for, alternatives per token).
    `top_logprobs` above 0 without the include would be ignored: a 400 instead."""
    if LOGPROBS in includes:
        return True, top_logprobs or 0
    if top_logprobs:
        raise BridgeError(400, f"top_logprobs: logprobs are returned only with include ['{LOGPROBS}']; add it, or "
                               "drop top_logprobs.", param="top_logprobs")
    return False, 0


def stream_logprobs(data: str) -> str:
    """A STREAM_TEXT_EVENTS event's JSON as OpenAI's stream types it: each logprob, and each of
    its alternatives, without `bytes` (deepseek-recipe writes the output_text part's shape)."""
    event = orjson.loads(data)
    for logprob in event.get("logprobs") or ():
        logprob.pop("bytes", None)
        for top in logprob.get("top_logprobs") or ():
            top.pop("bytes", None)
    return orjson.dumps(event).decode()


def item_view(item: dict[str, Any], includes: frozenset[str]) -> dict[str, Any]:
    """A stored item as a read shows it: logprobs only if `includes` asks.
    `item` is not changed (a copy is returned where something is hidden)."""
    content = item.get("content")
    if item.get("type") != "message" or not isinstance(content, list):
        return item
    shown = [_part_view(part, includes) if isinstance(part, dict) else part for part in content]
    return item if all(a is b for a, b in zip(shown, content, strict=True)) else {**item, "content": shown}


def _part_view(part: dict[str, Any], includes: frozenset[str]) -> dict[str, Any]:
    if part.get("type") == "output_text" and LOGPROBS not in includes and part.get("logprobs"):
        return {**part, "logprobs": []}
    return part


def items_view(items: Iterable[dict[str, Any]], includes: frozenset[str]) -> list[dict[str, Any]]:
    return [item_view(item, includes) for item in items]


def response_view(response: dict[str, Any], includes: frozenset[str]) -> dict[str, Any]:
    """A stored response object as a read shows it (its output items by `item_view`)."""
    output = response.get("output")
    if not isinstance(output, list):
        return response
    return {**response, "output": [item_view(i, includes) if isinstance(i, dict) else i for i in output]}


def replayable(item: dict[str, Any]) -> dict[str, Any]:
    """An item sent again as input to the model: without its logprobs (an answer's data, not the
    prompt's)."""
    return item_view(item, NONE)
