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
    messages_of,
    messages_tools,
    responses_input,
    responses_tools,
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


def test_the_same_turns_on_responses_and_anthropic_messages() -> None:
    calls = (ToolCall("a", "run", '{"command": "ls"}'), ToolCall("b", "run", '{"command": "pwd"}'))
    turns = [Turn("system", "sys"), Turn("user", "task"), Turn("assistant", "let me look", calls),
             Turn("tool", "x.txt", tool_call_id="a"), Turn("tool", "/w", tool_call_id="b")]
    assert responses_input(turns) == [
        {"role": "user", "content": "task"}, {"role": "assistant", "content": "let me look"},
        {"type": "function_call", "call_id": "a", "name": "run", "arguments": '{"command": "ls"}'},
        {"type": "function_call", "call_id": "b", "name": "run", "arguments": '{"command": "pwd"}'},
        {"type": "function_call_output", "call_id": "a", "output": "x.txt"},
        {"type": "function_call_output", "call_id": "b", "output": "/w"}]
    assert messages_of(turns) == [
        {"role": "user", "content": "task"},
        {"role": "assistant", "content": [{"type": "text", "text": "let me look"},
                                          {"type": "tool_use", "id": "a", "name": "run", "input": {"command": "ls"}},
                                          {"type": "tool_use", "id": "b", "name": "run", "input": {"command": "pwd"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "a", "content": "x.txt"},
                                     {"type": "tool_result", "tool_use_id": "b", "content": "/w"}]}]
    # A forced call names the tool on Messages: {"type": "any"} is served like auto.
    assert messages_tools("required")["tool_choice"] == {"type": "tool", "name": "run"}
    assert messages_tools("auto")["tool_choice"] == {"type": "auto"}
    assert messages_tools("auto")["thinking"] == {"type": "disabled"}
    assert responses_tools("required")["tool_choice"] == "required"
    assert responses_tools("auto")["reasoning"] == {"effort": "none"}
    assert messages_tools(None) == responses_tools(None) == {}
