"""End to end, OpenAI Chat Completions: the real openai SDK -> gateway -> workers, once per
engine: sim workers, and the DeepInfer wrapper on its interface double (conftest `engine`).

Tools (every tool_choice, thinking on and off), parallel calls, structured output,
stop sequences, sampling parameters, logprobs, reasoning, usage, an agent loop, images.
"""

from __future__ import annotations

import base64
import io
import json
from typing import Any

import httpx
import openai
import pytest
from PIL import Image

from tests.conftest import ENGINES

pytestmark = pytest.mark.parametrize("engine", ENGINES, indirect=True, scope="session")

MODEL = "DeepSeek-V4.1-Flash"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a time zone",
    "parameters": {"type": "object", "properties": {"tz": {"type": "string"}, "utc_offset": {"type": "integer"}},
                   "required": ["tz", "utc_offset"]}}}
THINKING = {True: {"thinking": {"type": "enabled"}}, False: {"thinking": {"type": "disabled"}}}


def _ask(client: openai.OpenAI, text: str = "What is the weather in Paris?", *, thinking: bool = True,
         **kwargs: Any) -> Any:
    kwargs.setdefault("max_tokens", 400)
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}],
                                          extra_body=THINKING[thinking], **kwargs)


@pytest.mark.parametrize("thinking", [True, False])
def test_tool_choice_auto_calls_a_tool_and_none_answers_in_text(openai_client: openai.OpenAI, thinking: bool) -> None:
    called = _ask(openai_client, thinking=thinking, tools=[WEATHER, CLOCK], tool_choice="auto")
    choice = called.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    answered = _ask(openai_client, thinking=thinking, tools=[WEATHER, CLOCK], tool_choice="none")
    assert answered.choices[0].finish_reason == "stop"
    assert answered.choices[0].message.content and not answered.choices[0].message.tool_calls


def test_tool_choice_required_and_named_without_thinking(openai_client: openai.OpenAI) -> None:
    required = _ask(openai_client, "Hello there", thinking=False, tools=[WEATHER, CLOCK], tool_choice="required")
    assert [c.function.name for c in required.choices[0].message.tool_calls] == ["get_weather"]
    named = _ask(openai_client, thinking=False, tools=[WEATHER, CLOCK],
                 tool_choice={"type": "function", "function": {"name": "get_time"}})
    (call,) = named.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    assert json.loads(call.function.arguments) == {"tz": "example", "utc_offset": 1}


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_thinking_mode_refuses_forcing_tool_choices(openai_client: openai.OpenAI, tool_choice: Any) -> None:
    # deepseek-recipe: thinking mode supports tool_choice auto and none only.
    with pytest.raises(openai.BadRequestError) as info:
        _ask(openai_client, thinking=True, tools=[WEATHER, CLOCK], tool_choice=tool_choice)
    assert "tool_choice" in str(info.value)


@pytest.mark.parametrize("stream", [False, True])
def test_parallel_tool_calls(openai_client: openai.OpenAI, stream: bool) -> None:
    text = "Call get_weather for Paris and get_time for Europe/Paris."
    if not stream:
        calls = _ask(openai_client, text, tools=[WEATHER, CLOCK]).choices[0].message.tool_calls
        names = [c.function.name for c in calls]
        ids = [c.id for c in calls]
    else:
        names, ids = [], []
        for chunk in _ask(openai_client, text, tools=[WEATHER, CLOCK], stream=True):
            for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                if delta.function and delta.function.name:
                    names.append(delta.function.name)
                    ids.append(delta.id)
    assert names == ["get_weather", "get_time"]
    assert len(set(ids)) == 2


def test_agent_loop_tool_call_then_tool_result_then_text(openai_client: openai.OpenAI) -> None:
    messages: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = openai_client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=400)
    message = first.choices[0].message
    (call,) = message.tool_calls  # type: ignore[misc]
    messages.append(message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp_c": 21})})
    final = openai_client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=400)
    assert final.choices[0].finish_reason == "stop"
    assert "tool" in final.choices[0].message.content and not final.choices[0].message.tool_calls


@pytest.mark.parametrize("thinking", [True, False])
def test_response_format_json_object_and_json_schema(openai_client: openai.OpenAI, thinking: bool) -> None:
    plain = _ask(openai_client, "Reply in JSON", thinking=thinking, response_format={"type": "json_object"})
    assert isinstance(json.loads(plain.choices[0].message.content), dict)
    schema = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags", "kind"],
              "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 3},
                             "tags": {"type": "array", "items": {"type": "string"}},
                             "kind": {"type": "string", "enum": ["cat", "dog"]}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": schema, "strict": True}}
    value = json.loads(_ask(openai_client, "A pet", thinking=thinking, response_format=fmt).choices[0].message.content)
    assert set(value) == {"name", "age", "tags", "kind"}
    assert isinstance(value["name"], str) and isinstance(value["age"], int) and value["age"] >= 3
    assert all(isinstance(t, str) for t in value["tags"]) and value["kind"] in ("cat", "dog")


def test_stop_sequence_ends_the_answer_streaming_and_not(openai_client: openai.OpenAI) -> None:
    full = _ask(openai_client, "x", thinking=False).choices[0].message.content
    cut = full.index(" ", 10)
    stop = full[cut:cut + 4]
    stopped = _ask(openai_client, "x", thinking=False, stop=[stop])
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].message.content == full[:cut]
    text = "".join(c.choices[0].delta.content or "" for c in _ask(openai_client, "x", thinking=False, stop=stop,
                                                                   stream=True) if c.choices)
    assert text == full[:cut]


def test_seed_temperature_top_p_are_accepted_and_seed_is_deterministic(openai_client: openai.OpenAI) -> None:
    a = _ask(openai_client, "Say something", seed=7, temperature=0.3, top_p=0.9)
    b = _ask(openai_client, "Say something", seed=7, temperature=0.3, top_p=0.9)
    assert a.choices[0].message.content == b.choices[0].message.content
    texts = {_ask(openai_client, "Say something", seed=s).choices[0].message.content for s in range(6)}
    assert len(texts) > 1


@pytest.mark.parametrize("param", ["max_tokens", "max_completion_tokens"])
def test_max_tokens_cuts_with_length(openai_client: openai.OpenAI, param: str) -> None:
    out = openai_client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                extra_body=THINKING[False], **{param: 5})
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 5


def test_developer_role_is_the_system_prompt(openai_client: openai.OpenAI) -> None:
    # Newer OpenAI clients send their instructions as `developer`: the engine sees the same prompt as for `system`.
    def prompt_tokens(role: str) -> int:
        out = openai_client.chat.completions.create(
            model=MODEL, max_tokens=1, extra_body=THINKING[False],
            messages=[{"role": role, "content": "Answer in French."},  # type: ignore[misc]
                      {"role": "user", "content": "Hi"}])
        return int(out.usage.prompt_tokens)
    assert prompt_tokens("developer") == prompt_tokens("system")
    without = openai_client.chat.completions.create(model=MODEL, max_tokens=1, extra_body=THINKING[False],
                                                    messages=[{"role": "user", "content": "Hi"}])
    assert prompt_tokens("developer") > without.usage.prompt_tokens


def test_logprobs_non_streaming_and_streaming(openai_client: openai.OpenAI) -> None:
    out = _ask(openai_client, "Hi", thinking=False, logprobs=True, top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    assert "".join(t.token for t in content) == out.choices[0].message.content
    for token in content:
        assert token.logprob <= 0 and len(token.top_logprobs) == 3
        assert token.top_logprobs[0].token == token.token
        assert token.top_logprobs[0].logprob >= token.top_logprobs[1].logprob
    streamed = [t for c in _ask(openai_client, "Hi", thinking=False, logprobs=True, stream=True)
                if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content or []]
    assert [t.logprob for t in streamed] == [t.logprob for t in content]
    assert _ask(openai_client, "Hi", thinking=False).choices[0].logprobs is None


def test_reasoning_effort_and_thinking_switch(openai_client: openai.OpenAI) -> None:
    thought = _ask(openai_client, "Hi", reasoning_effort="high")
    assert (thought.choices[0].message.model_extra or {}).get("reasoning_content")
    assert thought.usage.completion_tokens_details.reasoning_tokens > 0
    plain = _ask(openai_client, "Hi", thinking=False)
    assert not (plain.choices[0].message.model_extra or {}).get("reasoning_content")
    assert not plain.usage.completion_tokens_details or not plain.usage.completion_tokens_details.reasoning_tokens


def test_include_usage_gets_its_own_final_chunk(openai_client: openai.OpenAI) -> None:
    # Without include_usage, deepseek-recipe follows DeepSeek's API: usage rides on the last content chunk.
    chunks = list(_ask(openai_client, "Hi", stream=True))
    assert all(c.usage is None for c in chunks[:-1]) and chunks[-1].choices
    chunks = list(_ask(openai_client, "Hi", stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens > 0
    assert all(c.usage is None for c in chunks[:-1])


def _png(width: int = 64, height: int = 48) -> str:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (200, 10, 10)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _image_message(*urls: str) -> list[Any]:
    parts: list[Any] = [{"type": "text", "text": "What is in this picture?"}]
    parts += [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return [{"role": "user", "content": parts}]


def test_image_data_url_counts_its_image_tokens(openai_client: openai.OpenAI) -> None:
    text_only = openai_client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is in this picture?"}], max_tokens=8)
    one = openai_client.chat.completions.create(model=MODEL, messages=_image_message(_png()), max_tokens=8)
    # One <｜image｜> placeholder plus the image's token count beyond it (193 for a 64x48 image).
    assert one.usage.prompt_tokens - text_only.usage.prompt_tokens > 100


def test_remote_image_urls_are_off_by_default(gateway) -> None:
    r = httpx.post(gateway.url + "/v1/chat/completions",
                   json={"model": MODEL, "messages": _image_message("http://169.254.169.254/latest/meta-data")})
    assert r.status_code == 400
    assert "remote image URLs are disabled" in r.json()["error"]["message"]


def test_broken_image_is_a_clear_400(gateway) -> None:
    r = httpx.post(gateway.url + "/v1/chat/completions",
                   json={"model": MODEL, "messages": _image_message("data:image/png;base64,AAAA")})
    assert r.status_code == 400
    assert "unsupported image" in r.json()["error"]["message"]
