"""`include` through the real openai SDK and gateway: Responses logprobs (answered, streamed,
stored and shown only when a read asks), input image URLs on the item reads, and the 400 for
every value the gateway cannot honour."""

from __future__ import annotations

import base64
import io
from typing import Any

import openai
import pytest
from PIL import Image

from harness.launch import Gateway

MODEL = "deepseek-chat"  # without thinking: the answer is one message
LOGPROBS = "message.output_text.logprobs"
IMAGE_URL = "message.input_image.image_url"


def _client(gateway: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key="test", max_retries=0, timeout=60)


def _png() -> str:
    buf = io.BytesIO()
    Image.new("RGB", (32, 24), (10, 200, 10)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _text_part(response: Any) -> Any:
    (message,) = [item for item in response.output if item.type == "message"]
    (part,) = message.content
    return part


def _pairs(logprobs: Any) -> list[tuple[str, float]]:
    return [(lp.token, lp.logprob) for lp in logprobs]


def test_logprobs_answered_streamed_and_consistent_with_the_text(sim_gateway: Gateway) -> None:
    client = _client(sim_gateway)
    asked = {"model": MODEL, "input": "Say something short", "max_output_tokens": 24}
    answer = client.responses.create(**asked, include=[LOGPROBS], top_logprobs=3)
    part = _text_part(answer)
    assert part.text and part.logprobs
    assert b"".join(bytes(lp.bytes) for lp in part.logprobs).decode() == part.text  # every token of the text
    for lp in part.logprobs:
        assert lp.bytes == list(lp.token.encode()) or "\ufffd" in lp.token
        assert lp.logprob <= 0 and len(lp.top_logprobs) == 3
        assert lp.top_logprobs[0].token == lp.token and lp.top_logprobs[0].logprob == lp.logprob
        assert lp.top_logprobs[0].logprob >= lp.top_logprobs[1].logprob >= lp.top_logprobs[2].logprob
    assert answer.top_logprobs == 3

    deltas, done, final = [], None, None
    for event in client.responses.create(**asked, include=[LOGPROBS], top_logprobs=3, stream=True):
        if event.type == "response.output_text.delta":
            assert len(event.logprobs) >= 1 and "".join(lp.token for lp in event.logprobs) == event.delta
            assert all(set(lp.to_dict()) == {"token", "logprob", "top_logprobs"} for lp in event.logprobs)
            deltas += event.logprobs
        elif event.type == "response.output_text.done":
            done = event
        elif event.type == "response.completed":
            final = event.response
    assert _pairs(deltas) == _pairs(part.logprobs)  # the same prompt: the same answer
    assert all(len(lp.top_logprobs or []) == 3 for lp in deltas)
    assert done is not None and _pairs(done.logprobs) == _pairs(part.logprobs)
    assert final is not None and _pairs(_text_part(final).logprobs) == _pairs(part.logprobs)

    plain = client.responses.create(**asked)
    assert plain.output_text == answer.output_text and not _text_part(plain).logprobs
    assert all(not e.logprobs for e in client.responses.create(**asked, stream=True)
               if e.type == "response.output_text.delta")
    alone = client.responses.create(**asked, include=[LOGPROBS])  # no alternatives asked for
    assert _pairs(_text_part(alone).logprobs) == _pairs(part.logprobs)
    assert all(lp.top_logprobs == [] for lp in _text_part(alone).logprobs)


def test_stored_logprobs_are_shown_only_when_a_read_asks(sim_gateway: Gateway) -> None:
    client = _client(sim_gateway)
    conv = client.conversations.create()
    answer = client.responses.create(model=MODEL, input="Tell me a fact", max_output_tokens=16,
                                     include=[LOGPROBS], top_logprobs=2, conversation=conv.id)
    expected = _pairs(_text_part(answer).logprobs)
    assert expected
    assert not _text_part(client.responses.retrieve(answer.id)).logprobs
    assert _pairs(_text_part(client.responses.retrieve(answer.id, include=[LOGPROBS])).logprobs) == expected

    items = client.conversations.items.list(conv.id, order="asc").data
    assert [i.role for i in items] == ["user", "assistant"] and not items[1].content[0].logprobs
    shown = client.conversations.items.list(conv.id, order="asc", include=[LOGPROBS]).data
    assert _pairs(shown[1].content[0].logprobs) == expected
    one = client.conversations.items.retrieve(items[1].id, conversation_id=conv.id, include=[LOGPROBS])
    assert _pairs(one.content[0].logprobs) == expected

    # Sent again as input, without its logprobs: both ways of continuing answer.
    again = client.responses.create(model=MODEL, input="And another?", conversation=conv.id, max_output_tokens=8)
    follow = client.responses.create(model=MODEL, input="More?", previous_response_id=answer.id, max_output_tokens=8)
    assert again.output_text and follow.output_text
    assert again.usage is not None and answer.usage is not None
    assert again.usage.input_tokens > answer.usage.input_tokens + answer.usage.output_tokens


def test_input_image_urls_are_shown_on_every_read(sim_gateway: Gateway) -> None:
    """With or without the include: a client that sends listed items back as input needs them."""
    client = _client(sim_gateway)
    url = _png()
    picture = {"type": "message", "role": "user", "content": [
        {"type": "input_text", "text": "What colour is this?"}, {"type": "input_image", "image_url": url,
                                                                  "detail": "auto"}]}
    conv = client.conversations.create()
    added = client.conversations.items.create(conv.id, items=[picture])
    assert added.data[0].content[1].image_url == url
    shown = client.conversations.items.create(conv.id, items=[{**picture, "id": "msg_second"}], include=[IMAGE_URL])
    assert shown.data[0].content[1].image_url == url
    listed = client.conversations.items.list(conv.id, order="asc")
    assert [i.content[1].image_url for i in listed.data] == [url, url]
    assert [i.content[1].image_url for i in client.conversations.items.list(conv.id, include=[IMAGE_URL])] == [url] * 2
    item = client.conversations.items.retrieve("msg_second", conversation_id=conv.id)
    assert item.content[1].image_url == url and item.content[1].detail == "auto"
    # listed items sent back as input, as the Agents SDK's session does
    again = client.responses.create(model=MODEL, input=[i.model_dump(exclude_none=True) for i in listed.data][:1],
                                    max_output_tokens=8)
    assert again.output_text

    # The stored URL is what the model sees again (an image without one is a 400).
    answer = client.responses.create(model=MODEL, input=[picture], max_output_tokens=8, include=[IMAGE_URL])
    assert answer.output_text
    (stored,) = client.responses.input_items.list(answer.id).data
    assert stored.content[1].image_url == url
    (stored,) = client.responses.input_items.list(answer.id, include=[IMAGE_URL]).data
    assert stored.content[1].image_url == url
    follow = client.responses.create(model=MODEL, input="And now?", conversation=conv.id, max_output_tokens=8)
    assert follow.output_text


@pytest.mark.parametrize("value", ["file_search_call.results", "web_search_call.results",
                                   "web_search_call.action.sources", "code_interpreter_call.outputs",
                                   "computer_call_output.output.image_url", "reasoning.encrypted_content"])
def test_what_cannot_be_included_is_a_400_naming_it(sim_gateway: Gateway, value: str) -> None:
    client = _client(sim_gateway)
    conv = client.conversations.create(items=[{"type": "message", "role": "user", "content": "hi"}])
    stored = client.responses.create(model=MODEL, input="hi", max_output_tokens=2)
    calls = [
        lambda: client.responses.create(model=MODEL, input="hi", max_output_tokens=2, include=[value]),
        lambda: client.responses.create(model=MODEL, input="hi", max_output_tokens=2, stream=True, include=[value]),
        lambda: client.responses.retrieve(stored.id, include=[value]),
        lambda: client.responses.input_items.list(stored.id, include=[value]),
        lambda: client.conversations.items.list(conv.id, include=[value]),
        lambda: client.conversations.items.create(conv.id, items=[{"role": "user", "content": "x"}],
                                                  include=[value]),
    ]
    for call in calls:
        with pytest.raises(openai.BadRequestError) as refused:
            call()
        body = refused.value.body
        assert isinstance(body, dict) and body["param"] == "include" and value in body["message"]
        assert body["type"] == "invalid_request_error"
    assert len(client.conversations.items.list(conv.id).data) == 1  # the refused append added nothing


def test_top_logprobs_without_the_logprobs_include_is_a_400(sim_gateway: Gateway) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        _client(sim_gateway).responses.create(model=MODEL, input="hi", max_output_tokens=2, top_logprobs=5)
    assert refused.value.body["param"] == "top_logprobs" and LOGPROBS in refused.value.body["message"]
