"""loadgen/turns.py: a replayed agent's tool calls and results on the Chat Completions wire."""

from __future__ import annotations

from deepinfer_gateway.loadgen.turns import (
    AGENT_TOOL,
    EMPTY_RESULT,
    ToolCall,
    ToolCallParts,
    Turn,
    chat_message,
    chat_tools,
    results_of,
)


def test_turns_become_chat_messages_with_calls_and_results() -> None:
    call = ToolCall("call_1", "run", '{"command": "ls"}')
    assert chat_message(Turn("user", "hi")) == {"role": "user", "content": "hi"}
    assert chat_message(Turn("assistant", "", (call,))) == {
        "role": "assistant", "content": None,
        "tool_calls": [{"id": "call_1", "type": "function",
                        "function": {"name": "run", "arguments": '{"command": "ls"}'}}]}
    assert chat_message(Turn("tool", "out", tool_call_id="call_1")) == {
        "role": "tool", "tool_call_id": "call_1", "content": "out"}
    assert chat_tools(None) == {}
    assert chat_tools("required") == {"tools": [AGENT_TOOL], "tool_choice": "required",
                                      "reasoning_effort": "none"}


def test_streamed_call_deltas_are_put_together_by_index() -> None:
    parts = ToolCallParts()
    parts.add([{"index": 0, "id": "call_a", "type": "function", "function": {"name": "run", "arguments": ""}}])
    parts.add([{"index": 1, "id": "call_b", "function": {"name": "run", "arguments": '{"com'}}])
    parts.add([{"index": 0, "function": {"arguments": '{"command":'}},
               {"index": 1, "function": {"arguments": 'mand": 1}'}}])
    parts.add([{"index": 0, "function": {"arguments": ' "ls"}'}}])
    assert parts.calls() == (ToolCall("call_a", "run", '{"command": "ls"}'),
                             ToolCall("call_b", "run", '{"command": 1}'))
    assert ToolCallParts().calls() == ()


def test_a_rounds_input_answers_every_call_of_its_parent() -> None:
    calls = (ToolCall("a", "run", "{}"), ToolCall("b", "run", "{}"))
    assert results_of(calls, (Turn("user", "x"), Turn("user", "y"))) == (
        Turn("tool", "xy", tool_call_id="a"), Turn("tool", EMPTY_RESULT, tool_call_id="b"))
