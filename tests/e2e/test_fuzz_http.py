"""Fuzzing the HTTP surface with hypothesis-generated bodies, per endpoint, through the real
gateway: never a 5xx, every error in the endpoint's own protocol format, streams complete,
and afterwards no engine request is left running or waiting on any worker."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

MODEL = "DeepSeek-V4.1-Flash"


def _dumps(value: Any) -> bytes:
    return json.dumps(value).encode()  # stdlib: big ints and lone surrogates (escaped) are fair game


ENDPOINTS = ["/v1/chat/completions", "/v1/responses", "/v1/messages", "/v1/completions"]

scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False),
                    st.text(max_size=30))
json_values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                            st.dictionaries(st.text(max_size=12), inner, max_size=4)),
                           max_leaves=12)
texts = st.text(max_size=60)
small_ints = st.one_of(st.integers(-5, 40), st.sampled_from([0, 10**9, 2**63]), st.floats(-1, 50))
roles = st.sampled_from(["user", "assistant", "system", "developer", "tool", "function", "bogus", 7])
content_parts = st.one_of(
    texts,
    st.lists(st.one_of(
        st.fixed_dictionaries({"type": st.sampled_from(["text", "input_text", "output_text"]), "text": texts}),
        st.fixed_dictionaries({"type": st.just("image_url"), "image_url": st.fixed_dictionaries(
            {"url": st.sampled_from(["data:image/png;base64,AAAA", "data:,", "http://127.0.0.1/x.png", ""])})}),
        st.fixed_dictionaries({"type": st.just("image"), "source": json_values}),
        st.fixed_dictionaries({"type": st.sampled_from(["tool_use", "tool_result", "thinking"]),
                               "id": texts, "content": json_values}),
        json_values), max_size=3),
    json_values)
messages = st.lists(st.one_of(st.fixed_dictionaries({"role": roles, "content": content_parts},
                                                    optional={"tool_call_id": texts, "name": texts,
                                                              "tool_calls": json_values}),
                              json_values), max_size=4)
tool = st.one_of(
    st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
        {"name": st.sampled_from(["f", "get_weather", ""]), "parameters": json_values})}),
    st.fixed_dictionaries({"name": texts, "input_schema": json_values}),
    json_values)
common = {
    "model": st.sampled_from([MODEL, MODEL, "gpt-4o", "", 5]),
    "stream": st.one_of(st.booleans(), json_values),
    "temperature": st.one_of(st.floats(-1, 3), json_values),
    "top_p": st.one_of(st.floats(-0.5, 1.5), json_values),
    "seed": st.one_of(st.integers(-10, 2**64), json_values),
    "stop": st.one_of(texts, st.lists(texts, max_size=5), json_values),
    "tools": st.one_of(st.lists(tool, max_size=3), json_values),
    "tool_choice": st.one_of(st.sampled_from(["auto", "none", "required", "any"]), json_values),
    "thinking": st.one_of(st.fixed_dictionaries({"type": st.sampled_from(["enabled", "disabled", "x"])}), json_values),
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.booleans()}), json_values),
    "logprobs": st.one_of(st.booleans(), small_ints),
    "top_logprobs": small_ints,
    "response_format": st.one_of(st.fixed_dictionaries({"type": st.sampled_from(
        ["json_object", "json_schema", "text", "regex"]), "json_schema": json_values}), json_values),
    "reasoning_effort": st.one_of(st.sampled_from(["low", "medium", "high", "max"]), json_values),
    "n": small_ints, "echo": st.booleans(), "user": texts,
}
bodies = {
    "/v1/chat/completions": st.fixed_dictionaries({"messages": messages}, optional={
        **common, "max_tokens": small_ints, "max_completion_tokens": small_ints}),
    "/v1/responses": st.fixed_dictionaries({"input": st.one_of(texts, messages)}, optional={
        **common, "instructions": texts, "max_output_tokens": small_ints, "previous_response_id": texts}),
    "/v1/messages": st.fixed_dictionaries({"messages": messages, "max_tokens": small_ints}, optional={
        **common, "system": content_parts, "stop_sequences": st.lists(texts, max_size=3)}),
    "/v1/completions": st.fixed_dictionaries({"prompt": st.one_of(texts, st.lists(st.integers(-3, 200_000),
                                                                                 max_size=6), json_values)},
                                             optional={**common, "max_tokens": small_ints}),
}

# Well-formed requests with random (valid) options: these reach the workers.
words = st.text(st.characters(codec="utf-8"), min_size=1, max_size=40)
few_tokens = st.integers(1, 40)
sampling = {"stream": st.booleans(), "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1),
            "seed": st.integers(0, 2**40)}
chat_tool = st.just({"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}})
user_turn = st.fixed_dictionaries({"role": st.just("user"), "content": words})
valid = {
    "/v1/chat/completions": st.fixed_dictionaries({
        "model": st.just(MODEL), "messages": st.lists(user_turn, min_size=1, max_size=2), "max_tokens": few_tokens,
    }, optional={
        **sampling, "stop": st.lists(words, max_size=3), "logprobs": st.booleans(), "top_logprobs": st.integers(0, 5),
        "tools": st.lists(chat_tool, min_size=1, max_size=1), "tool_choice": st.sampled_from(["auto", "none"]),
        "thinking": st.fixed_dictionaries({"type": st.sampled_from(["enabled", "disabled"])}),
        "response_format": st.just({"type": "json_object"}),
        "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()})}),
    "/v1/responses": st.fixed_dictionaries({
        "model": st.just(MODEL), "input": words, "max_output_tokens": few_tokens,
    }, optional={
        **sampling, "instructions": words,
        "reasoning": st.fixed_dictionaries({"effort": st.sampled_from(["low", "high"])})}),
    "/v1/messages": st.fixed_dictionaries({
        "model": st.just(MODEL), "messages": st.lists(user_turn, min_size=1, max_size=1), "max_tokens": few_tokens,
    }, optional={
        **sampling, "system": words, "stop_sequences": st.lists(words, max_size=2),
        "thinking": st.sampled_from([{"type": "enabled", "budget_tokens": 1024}, {"type": "disabled"}])}),
    "/v1/completions": st.fixed_dictionaries({
        "model": st.just(MODEL), "prompt": st.one_of(words, st.lists(st.integers(0, 100_000), min_size=1, max_size=8)),
        "max_tokens": few_tokens,
    }, optional={
        **sampling, "stop": st.one_of(words, st.lists(words, max_size=4)), "logprobs": st.integers(0, 5),
        "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()})}),
}


def _body(path: str) -> st.SearchStrategy[bytes]:
    structured = bodies[path].map(_dumps)
    raw = st.one_of(json_values.map(_dumps), st.binary(max_size=40))
    return st.one_of(valid[path].map(_dumps), structured, raw)


def _check(path: str, response: httpx.Response, body: bytes) -> None:
    assert response.status_code < 500, (response.status_code, body[:300], response.text[:300])
    if response.status_code == 200:
        if response.headers["content-type"].startswith("text/event-stream"):
            assert b'"type":"error"' not in response.content and b'"error":{' not in response.content, response.text
        else:
            assert response.json().get("error") is None
        return
    payload = response.json()
    if path == "/v1/messages":
        assert payload["type"] == "error" and set(payload["error"]) >= {"type", "message"}, payload
    else:
        assert set(payload["error"]) >= {"message", "type", "param", "code"}, payload
    assert isinstance(payload["error"]["message"], str) and payload["error"]["message"]


@pytest.fixture(scope="module")
def http(gateway) -> Any:
    with httpx.Client(base_url=gateway.url, timeout=30) as client:
        yield client


@pytest.mark.parametrize("path", ENDPOINTS)
def test_fuzzed_bodies_never_5xx_and_errors_keep_the_protocol_format(http: httpx.Client, path: str) -> None:
    @settings(max_examples=60, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(body=_body(path))
    def run(body: bytes) -> None:
        response = http.post(path, content=body, headers={"content-type": "application/json"})
        _check(path, response, body)

    run()


def test_no_engine_request_leaks(http: httpx.Client, sim_cluster) -> None:
    # Runs after the fuzz tests (file order): every worker must be idle again.
    deadline = time.monotonic() + 2.0
    while True:
        loads = [httpx.get(u + "/v1/worker/load").json() for u in sim_cluster.urls]
        busy = [(lo["worker_id"], lo["running"], lo["waiting"]) for lo in loads if lo["running"] or lo["waiting"]]
        if not busy or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not busy, busy
