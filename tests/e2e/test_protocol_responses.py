"""End to end, OpenAI Responses: `client.responses.create` / `.stream` through the gateway."""

from __future__ import annotations

import json

import openai

MODEL = "DeepSeek-V4.1-Flash"
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
# ~1,500 tokens, so a repeat is served from a worker's prefix cache.
LONG = " ".join(f"note {i}: block {i * 13 % 997} stays cached." for i in range(200))


def test_non_streaming_response_with_reasoning_and_usage(openai_client: openai.OpenAI) -> None:
    response = openai_client.responses.create(model=MODEL, input="Hello", instructions="Be brief.",
                                              max_output_tokens=300)
    assert response.object == "response" and response.status == "completed"
    assert response.output_text
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.usage.output_tokens_details.reasoning_tokens > 0
    assert response.instructions == "Be brief." and response.max_output_tokens == 300


def test_streaming_events_parse_with_the_sdk_helpers(openai_client: openai.OpenAI) -> None:
    with openai_client.responses.stream(model=MODEL, input="Hello") as stream:
        types = [event.type for event in stream]
        final = stream.get_final_response()
    assert types[0] == "response.created" and types[-1] == "response.completed"
    assert {"response.in_progress", "response.output_item.added", "response.reasoning_text.delta",
            "response.output_text.delta", "response.output_text.done", "response.output_item.done"} <= set(types)
    assert final.output_text and final.usage.total_tokens == final.usage.input_tokens + final.usage.output_tokens


def test_cached_tokens_are_reported(openai_client: openai.OpenAI) -> None:
    first = openai_client.responses.create(model=MODEL, input=LONG + " first?", max_output_tokens=8)
    assert first.usage.input_tokens > 1000
    for _ in range(3):  # the router prefers the worker holding the prefix
        again = openai_client.responses.create(model=MODEL, input=LONG + " second?", max_output_tokens=8)
        if again.usage.input_tokens_details.cached_tokens:
            assert again.usage.input_tokens_details.cached_tokens >= 1024
            return
    raise AssertionError("a repeated prefix was never reported as cached")


def test_function_call_then_output_then_text(openai_client: openai.OpenAI) -> None:
    first = openai_client.responses.create(model=MODEL, input="Weather in Paris?", tools=[WEATHER])
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    follow = openai_client.responses.create(
        model=MODEL, tools=[WEATHER],
        input=[{"role": "user", "content": "Weather in Paris?"}, call.model_dump(exclude_none=True),
               {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp_c": 21}'}])
    assert follow.output_text and not [i for i in follow.output if i.type == "function_call"]
