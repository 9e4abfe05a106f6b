"""End to end, Anthropic Messages: the real anthropic SDK at POST /v1/messages."""

from __future__ import annotations

from typing import Any

import anthropic
import httpx
import pytest

MODEL = "DeepSeek-V4.1-Flash"
WEATHER = {"name": "get_weather", "description": "Current weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture
def client(gateway) -> Any:
    with anthropic.Anthropic(base_url=gateway.url, api_key="test", max_retries=0, timeout=60) as c:
        yield c


def test_create_with_system_prompt_and_thinking(client: anthropic.Anthropic) -> None:
    message = client.messages.create(model=MODEL, max_tokens=400, system="Be brief.",
                                     thinking={"type": "enabled", "budget_tokens": 200},
                                     messages=[{"role": "user", "content": "Hello"}])
    assert message.type == "message" and message.role == "assistant"
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert message.content[0].thinking and message.content[0].signature
    assert message.stop_reason == "end_turn"
    assert message.usage.input_tokens > 0 and message.usage.output_tokens > 0


def test_thinking_disabled_gives_text_only(client: anthropic.Anthropic) -> None:
    message = client.messages.create(model=MODEL, max_tokens=200, thinking={"type": "disabled"},
                                     messages=[{"role": "user", "content": "Hello"}])
    assert [b.type for b in message.content] == ["text"]


def test_stream_helper_text_and_final_message(client: anthropic.Anthropic) -> None:
    with client.messages.stream(model=MODEL, max_tokens=400, system=[{"type": "text", "text": "Be brief."}],
                                messages=[{"role": "user", "content": "Hello"}]) as stream:
        events = [event.type for event in stream]
        final = stream.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert {"content_block_start", "content_block_delta", "content_block_stop", "message_delta"} <= set(events)
    assert final.content[-1].type == "text" and final.content[-1].text
    assert final.usage.output_tokens > 0


def test_max_tokens_stop_reason(client: anthropic.Anthropic) -> None:
    message = client.messages.create(model=MODEL, max_tokens=3, thinking={"type": "disabled"},
                                     messages=[{"role": "user", "content": "Hello"}])
    assert message.stop_reason == "max_tokens"


@pytest.mark.parametrize("stream", [False, True])
def test_agent_loop_tool_use_then_tool_result_then_text(client: anthropic.Anthropic, stream: bool) -> None:
    messages: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
    if stream:
        with client.messages.stream(model=MODEL, max_tokens=400, tools=[WEATHER], messages=messages) as s:
            first = s.get_final_message()
    else:
        first = client.messages.create(model=MODEL, max_tokens=400, tools=[WEATHER], messages=messages)  # type: ignore[assignment]
    assert first.stop_reason == "tool_use"
    (use,) = [b for b in first.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.input == {"city": "Paris"}
    messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "21 C"}]}]
    final = client.messages.create(model=MODEL, max_tokens=400, tools=[WEATHER], messages=messages)
    assert final.stop_reason == "end_turn"
    assert final.content[-1].type == "text" and final.content[-1].text


def test_errors_are_anthropic_shaped(client: anthropic.Anthropic, gateway) -> None:
    with pytest.raises(anthropic.NotFoundError) as info:
        client.messages.create(model="claude-nope", max_tokens=10, messages=[{"role": "user", "content": "x"}])
    assert info.value.body == {"type": "error", "error": {
        "type": "not_found_error",
        "message": "The model `claude-nope` does not exist or you do not have access to it."}}
    for body in (b"{nope", b'{"model": "DeepSeek-V4.1-Flash"}', b"[]"):
        r = httpx.post(gateway.url + "/v1/messages", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400
        payload = r.json()
        assert payload["type"] == "error" and payload["error"]["type"] == "invalid_request_error"
        assert payload["error"]["message"]
