"""A replayed conversation's turns, and their shape on each protocol's wire.

With tool calls on (`bench --tool-calls`, sessions only), an agent's rounds go out as an agent
sends them: every request offers the agent's tool (`AGENT_TOOL`), a round whose conversation
another round continues forces a call of it (`tool_choice` `required`: the trace says the model
called a tool there), the last round of a chain leaves it to the model (`auto`, as agents send
it; after a tool result the sim answers text), and a round that continues a call sends its new
input as that call's result (a `tool` message). The model's call comes back in the next prompt
as the assistant's `tool_calls`, so the template renders it again: whether the cache still
holds that prefix is then measured, not assumed. Never `none`: deepseek-recipe then leaves
the tools out of the prompt, and the cached prefix ends where they began. Every round turns
thinking off (`chat_tools`). A forced call's length is the client's business (client.py:
`min_tokens` where the run sends `ignore_eos`).

The same turns on Responses (`function_call` / `function_call_output` items) and Anthropic
Messages (`tool_use` blocks, `tool_result` blocks in a user message); a forced call there is a
named tool (`{"type": "any"}` is served like `auto` by the V4.1 template, docs/api.md).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

# One shell-like tool, as coding agents offer; its one string argument is what the sim lengthens.
_NAME = "run"
_DESCRIPTION = "Run a shell command in the task's workspace and return its output."
_PARAMETERS = {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}
AGENT_TOOL: dict[str, Any] = {
    "type": "function", "function": {"name": _NAME, "description": _DESCRIPTION, "parameters": _PARAMETERS}}
# A call the model made without a result of its own in the trace (a parallel call beyond the first).
EMPTY_RESULT = "(no output)"


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as the model wrote it


@dataclass(frozen=True, slots=True)
class Turn:
    role: str  # "system", "user", "assistant" or "tool"
    text: str
    tool_calls: tuple[ToolCall, ...] = ()  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn's: the call it answers


def results_of(calls: Sequence[ToolCall], new_input: Sequence[Turn]) -> tuple[Turn, ...]:
    """A round's new input as the results of its parent's calls: the first call gets the input's
    text, any further call `EMPTY_RESULT` (every call needs its result)."""
    text = "".join(t.text for t in new_input)
    return tuple(Turn("tool", text if i == 0 else EMPTY_RESULT, tool_call_id=call.id)
                 for i, call in enumerate(calls))


def chat_message(turn: Turn) -> dict[str, Any]:
    if turn.role == "tool":
        return {"role": "tool", "tool_call_id": turn.tool_call_id, "content": turn.text}
    if not turn.tool_calls:
        return {"role": turn.role, "content": turn.text}
    return {"role": turn.role, "content": turn.text or None,
            "tool_calls": [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                           for c in turn.tool_calls]}


def chat_tools(tool_choice: str | None) -> dict[str, Any]:
    """The request's tool fields: none without tool calls (`tool_choice` None). Thinking off on
    every round: a forced call is served without it, and the V4.1 template renders the whole
    conversation differently in the other mode, so a mix would leave nothing cached. OpenAI's
    `reasoning_effort` says so: routers that model the request drop DeepSeek's `thinking`."""
    if tool_choice is None:
        return {}
    return {"tools": [AGENT_TOOL], "tool_choice": tool_choice, "reasoning_effort": "none"}


def responses_input(turns: Sequence[Turn]) -> list[dict[str, Any]]:
    """The turns after the system prompt (Responses takes that as `instructions`) as input items."""
    items: list[dict[str, Any]] = []
    for turn in turns:
        if turn.role == "system":
            continue
        if turn.role == "tool":
            items.append({"type": "function_call_output", "call_id": turn.tool_call_id, "output": turn.text})
            continue
        if turn.text or not turn.tool_calls:
            items.append({"role": turn.role, "content": turn.text})
        items += [{"type": "function_call", "call_id": c.id, "name": c.name, "arguments": c.arguments}
                  for c in turn.tool_calls]
    return items


def responses_tools(tool_choice: str | None) -> dict[str, Any]:
    """`chat_tools` on Responses (thinking off: `reasoning.effort` none)."""
    if tool_choice is None:
        return {}
    return {"tools": [{"type": "function", "name": _NAME, "description": _DESCRIPTION, "parameters": _PARAMETERS}],
            "tool_choice": tool_choice, "reasoning": {"effort": "none"}}


def messages_of(turns: Sequence[Turn]) -> list[dict[str, Any]]:
    """The turns after the system prompt as Anthropic messages: a call as a `tool_use` block, the
    results that follow it as `tool_result` blocks of one user message."""
    messages: list[dict[str, Any]] = []
    for turn in turns:
        if turn.role == "system":
            continue
        if turn.role == "tool":
            block = {"type": "tool_result", "tool_use_id": turn.tool_call_id, "content": turn.text}
            if messages and messages[-1]["role"] == "user" and isinstance(messages[-1]["content"], list):
                messages[-1]["content"].append(block)
            else:
                messages.append({"role": "user", "content": [block]})
        elif turn.tool_calls:
            text = [{"type": "text", "text": turn.text}] if turn.text else []
            messages.append({"role": turn.role, "content": text + [
                {"type": "tool_use", "id": c.id, "name": c.name, "input": json.loads(c.arguments)}
                for c in turn.tool_calls]})
        else:
            messages.append({"role": turn.role, "content": turn.text})
    return messages


def messages_tools(tool_choice: str | None) -> dict[str, Any]:
    """`chat_tools` on Anthropic Messages: `required` names the tool (`any` would be `auto`)."""
    if tool_choice is None:
        return {}
    choice = {"type": "tool", "name": _NAME} if tool_choice == "required" else {"type": tool_choice}
    return {"tools": [{"name": _NAME, "description": _DESCRIPTION, "input_schema": _PARAMETERS}],
            "tool_choice": choice, "thinking": {"type": "disabled"}}


class ToolCallParts:
    """A streamed answer's tool calls, put together from their deltas (Chat Completions' shape:
    the other protocols' events are added in it)."""

    def __init__(self) -> None:
        self._parts: dict[int, list[str]] = {}  # index -> [id, name, arguments so far]

    def add(self, deltas: Iterable[dict[str, Any]]) -> None:
        for delta in deltas:
            part = self._parts.setdefault(int(delta.get("index") or 0), ["", "", ""])
            function = delta.get("function") or {}
            part[0] = delta.get("id") or part[0]
            part[1] = function.get("name") or part[1]
            part[2] += function.get("arguments") or ""

    def calls(self) -> tuple[ToolCall, ...]:
        return tuple(ToolCall(*self._parts[i]) for i in sorted(self._parts))
