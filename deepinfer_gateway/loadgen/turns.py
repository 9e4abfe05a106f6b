"""A replayed conversation's turns, and their shape on the Chat Completions wire.

With tool calls on (`bench --tool-calls`, sessions only), an agent's rounds go out as an agent
sends them: every request offers the agent's tool (`AGENT_TOOL`), a round whose conversation
another round continues forces a call of it (`tool_choice` `required`: the trace says the model
called a tool there), the last round of a chain leaves it to the model (`auto`, as agents send
it; after a tool result the sim answers text), and a round that continues a call sends its new
input as that call's result (a `tool` message). The model's call comes back in the next prompt
as the assistant's `tool_calls`, so the template renders it again: whether the cache still
holds that prefix is then measured, not assumed. Never `none`: deepseek-recipe then leaves
the tools out of the prompt, and the cached prefix ends where they began.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

# One shell-like tool, as coding agents offer (its schema's one string makes the sim's call short).
AGENT_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "run",
        "description": "Run a shell command in the task's workspace and return its output.",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
    },
}
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


class ToolCallParts:
    """A streamed answer's tool calls, put together from their Chat Completions deltas."""

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
