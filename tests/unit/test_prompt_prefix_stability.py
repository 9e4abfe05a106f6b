"""What keeps a conversation's rendered prefix, and so its cache (docs/api.md, "Thinking mode"):
one thinking mode throughout, and no `tool_choice: none` (deepseek-recipe leaves the tools out)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from deepinfer_gateway.core.protocol import DEFAULT_MODEL
from deepinfer_gateway.loadgen.turns import AGENT_TOOL
from deepinfer_gateway.recipe_bridge.encoder import PromptEncoder
from deepinfer_gateway.recipe_bridge.prepare import ApiProtocol, BridgeConfig, RequestPreparer
from deepinfer_gateway.recipe_bridge.tokenizer import load_tokenizer

FIRST = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "Do the task."}]
CALL = {"id": "c1", "type": "function", "function": {"name": "run", "arguments": '{"command": "ls"}'}}
SECOND = [*FIRST, {"role": "assistant", "content": None, "tool_calls": [CALL]},
          {"role": "tool", "tool_call_id": "c1", "content": "a.txt"}]


@pytest.fixture(scope="module")
def preparer() -> RequestPreparer:
    return RequestPreparer(PromptEncoder(load_tokenizer(None)), BridgeConfig())


def _ids(preparer: RequestPreparer, messages: list[dict[str, Any]], **fields: Any) -> list[int]:
    body = {"model": DEFAULT_MODEL, "messages": messages, "tools": [AGENT_TOOL], "max_tokens": 8, **fields}
    return list(preparer.prepare(ApiProtocol.CHAT, orjson.dumps(body)).token_ids)


def _common(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def test_one_thinking_mode_keeps_the_prefix_and_a_switch_loses_it(preparer: RequestPreparer) -> None:
    first = _ids(preparer, FIRST, tool_choice="required")  # a forced call: served without thinking
    same_mode = _ids(preparer, SECOND, tool_choice="auto", reasoning_effort="none")
    switched = _ids(preparer, SECOND, tool_choice="auto")  # the served name's default: thinking
    assert _common(first, same_mode) == len(first)
    assert _common(first, switched) < len(first) // 10


def test_tool_choice_none_leaves_the_tools_out_of_the_prompt(preparer: RequestPreparer) -> None:
    auto = _ids(preparer, FIRST, tool_choice="auto", reasoning_effort="none")
    none = _ids(preparer, FIRST, tool_choice="none", reasoning_effort="none")
    assert len(none) < len(auto) // 4 and _common(auto, none) < len(none)
