"""`include` (recipe_bridge/includes.py): the values honoured, the 400 naming each refused one,
what a read shows of a stored item, and Responses logprobs from the request to the answer."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from deepinfer_gateway.core.errors import BridgeError
from deepinfer_gateway.recipe_bridge.encoder import PromptEncoder
from deepinfer_gateway.recipe_bridge.includes import (
    INPUT_IMAGE_URL,
    LOGPROBS,
    NONE,
    includes_of,
    item_view,
    logprobs_asked,
    replayable,
    response_view,
    stream_logprobs,
)
from deepinfer_gateway.recipe_bridge.prepare import ApiProtocol, BridgeConfig, RequestPreparer
from deepinfer_gateway.recipe_bridge.stream import response_stream
from deepinfer_gateway.recipe_bridge.tokenizer import load_tokenizer

MODEL = "DeepSeek-V4.1-Flash"
REFUSED = ["file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
           "code_interpreter_call.outputs", "computer_call_output.output.image_url", "reasoning.encrypted_content"]
LP = [{"token": "Hi", "bytes": [72, 105], "logprob": -0.1, "top_logprobs": []}]
ANSWER = {"id": "msg_1", "type": "message", "role": "assistant", "status": "completed",
          "content": [{"type": "output_text", "text": "Hi", "annotations": [], "logprobs": LP}]}
PICTURE = {"id": "msg_2", "type": "message", "role": "user", "content": [
    {"type": "input_text", "text": "what is this?"},
    {"type": "input_image", "detail": "auto", "image_url": "data:image/png;base64,AAAA"}]}


def test_the_honoured_values_are_read() -> None:
    assert includes_of(None) == NONE and includes_of([]) == NONE
    assert includes_of([LOGPROBS, INPUT_IMAGE_URL, LOGPROBS]) == {LOGPROBS, INPUT_IMAGE_URL}


@pytest.mark.parametrize("value", REFUSED)
def test_every_other_includable_value_is_a_400_naming_it_and_why(value: str) -> None:
    with pytest.raises(BridgeError) as refused:
        includes_of([LOGPROBS, value])
    assert refused.value.status_code == 400 and refused.value.param == "include"
    assert value in refused.value.message
    assert ("hosted tools" in refused.value.message) != (value == "reasoning.encrypted_content")


@pytest.mark.parametrize("value", [["no.such.value"], "message.output_text.logprobs", [1], {"a": 1}])
def test_an_unknown_or_malformed_include_is_a_400(value: Any) -> None:
    with pytest.raises(BridgeError) as refused:
        includes_of(value)
    assert refused.value.status_code == 400 and refused.value.param == "include"


def test_logprobs_are_asked_for_by_the_include_and_top_logprobs_needs_it() -> None:
    assert logprobs_asked(frozenset({LOGPROBS}), 5) == (True, 5)
    assert logprobs_asked(frozenset({LOGPROBS}), None) == (True, 0)
    assert logprobs_asked(NONE, None) == (False, 0) and logprobs_asked(NONE, 0) == (False, 0)
    with pytest.raises(BridgeError) as refused:  # it would change nothing: not accepted and ignored
        logprobs_asked(frozenset({INPUT_IMAGE_URL}), 3)
    assert refused.value.param == "top_logprobs" and LOGPROBS in refused.value.message


def test_a_read_shows_logprobs_only_when_asked_and_image_urls_always() -> None:
    kept = orjson.dumps([ANSWER, PICTURE])
    assert item_view(ANSWER, NONE)["content"][0]["logprobs"] == []
    assert item_view(ANSWER, frozenset({LOGPROBS}))["content"][0]["logprobs"] == LP
    assert item_view(PICTURE, NONE) is PICTURE
    assert item_view(PICTURE, frozenset({INPUT_IMAGE_URL})) is PICTURE
    assert orjson.dumps([ANSWER, PICTURE]) == kept  # the stored items are not changed
    call = {"type": "function_call", "id": "fc_1", "call_id": "c", "name": "f", "arguments": "{}"}
    assert item_view(call, NONE) is call


def test_a_stored_response_and_a_replayed_item() -> None:
    response = {"id": "resp_1", "object": "response", "output": [{"type": "reasoning", "id": "rs_1"}, ANSWER]}
    assert response_view(response, NONE)["output"][1]["content"][0]["logprobs"] == []
    assert response_view(response, frozenset({LOGPROBS})) == response
    assert replayable(ANSWER)["content"][0]["logprobs"] == [] and replayable(PICTURE) is PICTURE


@pytest.fixture(scope="module")
def preparer() -> RequestPreparer:
    return RequestPreparer(PromptEncoder(load_tokenizer()), BridgeConfig(model_names=(MODEL,)))


def _prepare(preparer: RequestPreparer, **fields: Any) -> Any:
    return preparer.prepare(ApiProtocol.RESPONSES, orjson.dumps({"model": MODEL, "input": "hi", **fields}))


def test_a_responses_request_asks_the_engine_for_logprobs_only_with_the_include(preparer: RequestPreparer) -> None:
    asked = _prepare(preparer, include=[LOGPROBS], top_logprobs=4).sampling
    assert asked.logprobs and asked.top_logprobs == 4
    plain = _prepare(preparer, include=[INPUT_IMAGE_URL]).sampling
    assert not plain.logprobs and plain.top_logprobs == 0
    for fields in ({"top_logprobs": 2}, {"include": ["reasoning.encrypted_content"]}):
        with pytest.raises(BridgeError) as refused:
            _prepare(preparer, **fields)
        assert refused.value.status_code == 400 and refused.value.param in fields


def test_stream_events_carry_logprobs_without_bytes() -> None:
    event = {"type": "response.output_text.delta", "delta": "Hi", "logprobs": [
        {"token": "Hi", "logprob": -0.1, "bytes": [72, 105], "top_logprobs": [
            {"token": "Hi", "logprob": -0.1, "bytes": [72, 105]},
            {"token": "Ho", "logprob": -2.0, "bytes": [72, 111]}]}]}
    assert orjson.loads(stream_logprobs(orjson.dumps(event).decode()))["logprobs"] == [
        {"token": "Hi", "logprob": -0.1, "top_logprobs": [{"token": "Hi", "logprob": -0.1},
                                                          {"token": "Ho", "logprob": -2.0}]}]


def _answer(preparer: RequestPreparer, stream: bool, text: str, **fields: Any) -> tuple[list[int], bytes]:
    """`text` answered by a stand-in engine (two steps; each token's logprob -0.01 * its position,
    its alternative the next id at -5), through the Responses output path."""
    prepared = _prepare(preparer, model="deepseek-chat", stream=stream, **fields)
    bundle = preparer.encoder.bundle
    ids = bundle.tokenizer.encode(text)
    top = prepared.sampling.top_logprobs
    logprobs = [[-0.01 * i, [[t, -0.01 * i], [t + 1, -5.0]][:top]] for i, t in enumerate(ids)]
    out = response_stream(prepared, bundle, "resp_test")
    half = len(ids) // 2
    sent = out.ready(10, 0)
    for part in (slice(0, half), slice(half, None)):
        sent += out.tokens(ids[part], logprobs[part] if prepared.sampling.logprobs else None)
    sent += out.finish("stop")
    return ids, sent if stream else out.body()


def _events(sent: bytes) -> list[dict[str, Any]]:
    return [orjson.loads(line[6:]) for line in sent.split(b"\n") if line.startswith(b"data: ")]


def test_responses_logprobs_follow_the_text_in_the_answer_and_the_stream(preparer: RequestPreparer) -> None:
    text = "Hello wörld! 你好"
    ids, body = _answer(preparer, False, text, include=[LOGPROBS], top_logprobs=2)
    (part,) = orjson.loads(body)["output"][0]["content"]
    assert part["text"] == text and len(part["logprobs"]) == len(ids)
    assert b"".join(bytes(lp["bytes"]) for lp in part["logprobs"]).decode() == text
    assert [lp["logprob"] for lp in part["logprobs"]] == pytest.approx([-0.01 * i for i in range(len(ids))])
    assert all(lp["top_logprobs"][0]["token"] == lp["token"] and len(lp["top_logprobs"]) == 2
               for lp in part["logprobs"])

    _, sent = _answer(preparer, True, text, include=[LOGPROBS], top_logprobs=2)
    events = _events(sent)
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert len(deltas) == 2 and "".join(e["delta"] for e in deltas) == text
    streamed = [lp for e in deltas for lp in e["logprobs"]]
    assert [lp["token"] for lp in streamed] == [lp["token"] for lp in part["logprobs"]]
    assert all(set(lp) == {"token", "logprob", "top_logprobs"} for lp in streamed)  # OpenAI's stream type
    (done,) = [e for e in events if e["type"] == "response.output_text.done"]
    assert done["logprobs"] == streamed
    (completed,) = [e for e in events if e["type"] == "response.completed"]
    assert completed["response"]["output"][0]["content"][0]["logprobs"] == part["logprobs"]

    _, plain = _answer(preparer, False, text)
    assert orjson.loads(plain)["output"][0]["content"][0]["logprobs"] == []
    _, plain = _answer(preparer, True, text)
    assert all(e["logprobs"] == [] for e in _events(plain) if e["type"] == "response.output_text.delta")
