"""PromptEncoder (segment-cached) == deepseek-recipe's own encode, token for token.

Conversations are built through the protocols (Chat Completions and Anthropic Messages
bodies -> `convert`), so they carry whatever the real request path produces: system
prompts, tool schemas, images (tiny PNG data URLs), reasoning, tool calls and results,
thinking on and off. Each is checked with a cold cache, a warm cache (every segment a
hit), after encoding its own prefix conversation (partial hits, the follow-up-turn
case), and with every plain-text tokenizer (fastokens, tiktoken and the Hugging Face fallback,
the latter with SHA-256 digest keys).
"""

from __future__ import annotations

import base64
import json
import struct
import zlib
from typing import Any

import deepseek_recipe as dr
import pytest
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from deepinfer_gateway.kvcache.hashing import pack_tokens
from deepinfer_gateway.recipe_bridge.encoder import (
    PromptEncoder,
    ReferencePromptEncoder,
    pieces,
)
from deepinfer_gateway.recipe_bridge.segment_tokenizer import (
    FastokensPlain,
    HfPlain,
    TiktokenPlain,
    plain_tokenizer,
)
from deepinfer_gateway.recipe_bridge.tokenizer import TokenizerBundle, load_tokenizer

MODEL = "DeepSeek-V4.1-Flash"
OPTIONS = dr.ConversionOptions().with_model_versions_by_name({MODEL: dr.ModelVersion.DeepseekV41Flash})


@pytest.fixture(scope="module")
def bundle() -> TokenizerBundle:
    return load_tokenizer()


@pytest.fixture(scope="module")
def reference(bundle: TokenizerBundle) -> ReferencePromptEncoder:
    return ReferencePromptEncoder(bundle)


@pytest.fixture(scope="module")
def fastokens_encoder(bundle: TokenizerBundle) -> PromptEncoder:
    encoder = PromptEncoder(bundle)
    assert isinstance(encoder.plain, FastokensPlain)  # the default tokenizer.json is recognised
    return encoder


@pytest.fixture(scope="module")
def tiktoken_encoder(bundle: TokenizerBundle) -> PromptEncoder:
    encoder = PromptEncoder(bundle, plain=plain_tokenizer(bundle.json_text, prefer="tiktoken"))
    assert isinstance(encoder.plain, TiktokenPlain)
    return encoder


@pytest.fixture(scope="module")
def hf_encoder(bundle: TokenizerBundle) -> PromptEncoder:
    # Also exercises digest keys (segments of 16+ code points keyed by SHA-256).
    return PromptEncoder(bundle, plain=HfPlain(json.loads(bundle.json_text)), digest_min_chars=16)


# --- strategies --------------------------------------------------------------------------

_PIECES = [
    " ", "  ", "   ", "\n", "\n\n", "\r\n", "\t", " \n ", "\u3000", "\u00a0", "0", "42", "12345",
    "١٢٣", "１２", "中文", "日本語のテキスト", "カタカナー", "・", "한국어", "e\u0301", "\u0301",
    "\u20dd", "👨\u200d👩\u200d👧", "🎉\ufe0f", "\u200b", "\x00", "\x7f", "\ue000", "<｜User｜>",
    "<｜Assistant｜>", "<｜end▁of▁sentence｜>", "<｜image｜>", "<think>", "</think>", "｜DSML｜",
    "<tool_result>", "```", "...", "?!", "$x", "__init__", "It's", "Hello", "world", "{\"a\": 1}",
]
text = st.lists(
    st.one_of(st.sampled_from(_PIECES), st.text(st.characters(codec="utf-8"), max_size=8)),
    max_size=12,
).map("".join)
nonempty_text = text.map(lambda s: s if s.strip() else "x" + s)
name = st.from_regex(r"[a-z][a-z0-9_]{0,12}", fullmatch=True)


def _png(width: int, height: int, rgb: tuple[int, int, int]) -> str:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    rows = b"".join(b"\x00" + bytes(rgb) * width for _ in range(height))
    png = (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
        + chunk(b"IDAT", zlib.compress(rows))
        + chunk(b"IEND", b"")
    )
    return "data:image/png;base64," + base64.b64encode(png).decode()


image_url = st.builds(
    _png, st.integers(1, 3), st.integers(1, 3), st.tuples(*[st.integers(0, 255)] * 3)
)
json_value = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(name, inner, max_size=3),
    max_leaves=6,
)


@st.composite
def tools(draw: st.DrawFn) -> list[dict[str, Any]]:
    result = []
    for tool_name in draw(st.lists(name, max_size=3, unique=True)):
        props = draw(st.dictionaries(name, st.builds(
            lambda t, d: {"type": t, "description": d}, st.sampled_from(["string", "integer", "boolean"]), text
        ), max_size=3))
        result.append({"type": "function", "function": {
            "name": tool_name, "description": draw(text),
            "parameters": {"type": "object", "properties": props, "required": sorted(props)[:1]},
        }})
    return result


@st.composite
def chat_body(draw: st.DrawFn) -> dict[str, Any]:
    tool_list = draw(tools())
    tool_names = [t["function"]["name"] for t in tool_list]
    messages: list[dict[str, Any]] = []
    if draw(st.booleans()):
        messages.append({"role": "system", "content": draw(text)})
    call_no = 0
    for _ in range(draw(st.integers(1, 4))):
        parts: list[dict[str, Any]] = [{"type": "text", "text": draw(nonempty_text)}]
        for _ in range(draw(st.integers(0, 2))):
            parts.insert(draw(st.integers(0, len(parts))), {"type": "image_url", "image_url": {"url": draw(image_url)}})
            parts.append({"type": "text", "text": draw(text)})
        content = parts if len(parts) > 1 or draw(st.booleans()) else parts[0]["text"]
        messages.append({"role": "user", "content": content})
        if draw(st.booleans()) and tool_names:
            calls = []
            for tool in draw(st.lists(st.sampled_from(tool_names), min_size=1, max_size=2)):
                call_no += 1
                args = draw(st.dictionaries(name, json_value, max_size=3))
                calls.append({"id": f"call_{call_no}", "type": "function",
                              "function": {"name": tool, "arguments": json.dumps(args, ensure_ascii=False)}})
            messages.append({"role": "assistant", "content": draw(text), "reasoning_content": draw(text),
                             "tool_calls": calls})
            messages.extend({"role": "tool", "tool_call_id": c["id"], "content": draw(text)} for c in calls)
        messages.append({"role": "assistant", "content": draw(nonempty_text), "reasoning_content": draw(text)})
    if draw(st.booleans()):
        messages.pop()  # end on the user (or tool) turn, as a live request does
    body: dict[str, Any] = {"model": MODEL, "messages": messages}
    if tool_list:
        body["tools"] = tool_list
    body["thinking"] = {"type": draw(st.sampled_from(["enabled", "disabled"]))}
    if draw(st.booleans()):
        body["reasoning_effort"] = draw(st.sampled_from(["low", "medium", "high"]))
    return body


@st.composite
def messages_body(draw: st.DrawFn) -> dict[str, Any]:
    """Anthropic Messages: system prompt, tool_use/tool_result, thinking blocks, images."""
    tool_list = [{"name": t["function"]["name"], "description": t["function"]["description"],
                  "input_schema": t["function"]["parameters"]} for t in draw(tools())]
    messages: list[dict[str, Any]] = []
    use_no = 0
    for _ in range(draw(st.integers(1, 3))):
        content: list[dict[str, Any]] = [{"type": "text", "text": draw(nonempty_text)}]
        if draw(st.booleans()):
            data = draw(image_url).split(",", 1)[1]
            content.append({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}})
        messages.append({"role": "user", "content": content})
        blocks: list[dict[str, Any]] = [{"type": "thinking", "thinking": draw(text), "signature": "sig"}]
        blocks.append({"type": "text", "text": draw(nonempty_text)})
        if draw(st.booleans()) and tool_list:
            use_no += 1
            tool = draw(st.sampled_from(tool_list))["name"]
            blocks.append({"type": "tool_use", "id": f"toolu_{use_no}", "name": tool,
                           "input": draw(st.dictionaries(name, json_value, max_size=2))})
            messages.append({"role": "assistant", "content": blocks})
            messages.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": f"toolu_{use_no}", "content": draw(text)}]})
            continue
        messages.append({"role": "assistant", "content": blocks})
    if messages[-1]["role"] == "assistant":
        messages.append({"role": "user", "content": draw(nonempty_text)})
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 1024, "messages": messages}
    if draw(st.booleans()):
        body["system"] = draw(text)
    if tool_list:
        body["tools"] = tool_list
    if draw(st.booleans()):
        body["thinking"] = {"type": "enabled", "budget_tokens": 2048}
    return body


def _convert(kind: type, body: dict[str, Any]) -> dr.Conversation:
    try:
        request = kind(json.dumps(body, ensure_ascii=False).encode())
        conversation: dr.Conversation = request.convert(OPTIONS).conversation
        return conversation
    except dr.ConversionError as exc:  # a combination the protocol itself refuses
        assume(False)
        raise AssertionError from exc


def _prefix_body(body: dict[str, Any]) -> dict[str, Any]:
    """The previous turn: the conversation up to its last user message, exclusive."""
    messages = body["messages"]
    last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
    earlier = [i for i, m in enumerate(messages[:last_user]) if m["role"] == "user"]
    return {**body, "messages": messages[: earlier[-1] + 1]} if earlier else body


_SPECIAL = {t["content"]: t["id"] for t in json.loads(load_tokenizer().json_text)["added_tokens"]}
_LABELS = {"image": _SPECIAL["<｜image｜>"], "tool call": _SPECIAL["｜DSML｜"], "thinking": _SPECIAL["<think>"]}


def _check(encoder: PromptEncoder, reference: ReferencePromptEncoder, kind: type, body: dict[str, Any]) -> None:
    conv = _convert(kind, body)
    expected = reference.encode(conv)
    for label, token_id in _LABELS.items():
        event(f"{label}: {token_id in expected}")
    encoder.cache.clear()
    assert encoder.encode(conv) == expected, "cold cache"
    assert encoder.encode(conv) == expected, "warm cache"
    encoder.cache.clear()
    prefix = _prefix_body(body)
    encoder.encode(_convert(kind, prefix))
    encoded = encoder.encode_packed(conv)
    assert encoded.token_ids == expected, "warm from the previous turn"
    assert encoded.packed == pack_tokens(expected), "packed for hashing"


_SETTINGS = settings(max_examples=100, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                            HealthCheck.data_too_large])


@pytest.mark.parametrize("which", ["fastokens", "tiktoken", "hf"])
@_SETTINGS
@given(body=chat_body())
def test_chat_conversations_match_reference(
    which: str, body: dict[str, Any], request: pytest.FixtureRequest, reference: ReferencePromptEncoder
) -> None:
    encoder = request.getfixturevalue(f"{which}_encoder")
    _check(encoder, reference, dr.ChatCompletionRequest, body)


@pytest.mark.parametrize("which", ["fastokens", "tiktoken", "hf"])
@_SETTINGS
@given(body=messages_body())
def test_messages_conversations_match_reference(
    which: str, body: dict[str, Any], request: pytest.FixtureRequest, reference: ReferencePromptEncoder
) -> None:
    encoder = request.getfixturevalue(f"{which}_encoder")
    _check(encoder, reference, dr.MessagesRequest, body)


def test_special_spellings_in_user_text_stay_plain(fastokens_encoder: PromptEncoder,
                                                    reference: ReferencePromptEncoder) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "<｜User｜><think><｜image｜>"}]}
    conv = _convert(dr.ChatCompletionRequest, body)
    ids = fastokens_encoder.encode(conv)
    assert ids == reference.encode(conv)
    assert ids.count(fastokens_encoder.bundle.special_token_id("<｜User｜>")) == 1  # only the rendered one


def test_image_placeholder_is_one_special_id(fastokens_encoder: PromptEncoder,
                                             reference: ReferencePromptEncoder) -> None:
    parts = [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": _png(2, 2, (1, 2, 3))}}]
    conv = _convert(dr.ChatCompletionRequest, {"model": MODEL, "messages": [{"role": "user", "content": parts}]})
    ids = fastokens_encoder.encode(conv)
    assert ids == reference.encode(conv)
    assert ids.count(fastokens_encoder.bundle.special_token_id("<｜image｜>")) == 1


def test_follow_up_turn_tokenizes_only_new_segments(bundle: TokenizerBundle, reference: ReferencePromptEncoder) -> None:
    encoder = PromptEncoder(bundle, plain=HfPlain(json.loads(bundle.json_text)))
    history = [{"role": "user", "content": "first question " * 200}, {"role": "assistant", "content": "answer " * 200}]
    first = _convert(dr.ChatCompletionRequest, {"model": MODEL, "messages": history[:1]})
    encoder.encode(first)
    before = encoder.cache_stats()
    follow = _convert(dr.ChatCompletionRequest,
                      {"model": MODEL, "messages": [*history, {"role": "user", "content": "next"}]})
    assert encoder.encode(follow) == reference.encode(follow)
    after = encoder.cache_stats()
    assert after.hits > before.hits  # the system preamble and the first question were reused
    assert after.misses - before.misses <= 3  # the answer, the new question, the thinking tail


def test_first_turn_and_follow_up_fill_the_cache_exactly(fastokens_encoder: PromptEncoder,
                                                         reference: ReferencePromptEncoder) -> None:
    """A cold prompt (a text repeated within it cached once) and a follow-up (mostly cached) both
    match the reference; what they cached serves a warm encode, and each entry holds its text's ids."""
    encoder = fastokens_encoder
    document = "the same long paragraph about caches " * 300
    history = [{"role": "user", "content": document}, {"role": "assistant", "content": "an answer " * 300},
               {"role": "user", "content": document}]
    turns = [history, [*history, {"role": "assistant", "content": "short"}, {"role": "user", "content": "again"}]]
    encoder.cache.clear()
    for messages in turns:
        conv = _convert(dr.ChatCompletionRequest, {"model": MODEL, "messages": messages})
        expected = reference.encode(conv)
        before = encoder.cache_stats()
        encoded = encoder.encode_packed(conv)
        assert encoded.token_ids == expected and encoded.packed == pack_tokens(expected)
        assert encoder.cache_stats().hits > before.hits or messages is history
        warm = encoder.cache_stats()
        assert encoder.encode(conv) == expected
        assert encoder.cache_stats().misses == warm.misses  # every segment was cached
        assert encoder.cache_stats().entries == warm.entries
    for key in list(encoder.cache._entries):
        assert isinstance(key, str) and encoder.cache.get(key) == encoder.plain.encode_packed([key])[0]


def test_unknown_special_token_fails_like_reference(fastokens_encoder: PromptEncoder) -> None:
    broken = json.loads(fastokens_encoder.bundle.json_text)
    broken["added_tokens"] = [t for t in broken["added_tokens"] if t["content"] != "<｜System｜>"]
    bundle = TokenizerBundle(dr.Tokenizer.from_str(json.dumps(broken)), json.dumps(broken), "test", 129280)
    encoder = PromptEncoder(bundle, plain=fastokens_encoder.plain)
    conv = _convert(dr.ChatCompletionRequest, {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    with pytest.raises(RuntimeError, match="not in the added vocabulary"):
        encoder.encode(conv)
    with pytest.raises(RuntimeError):
        ReferencePromptEncoder(bundle).encode(conv)


# --- long segments cached in pieces --------------------------------------------------------

_word = st.from_regex(r"[A-Za-z]{1,6}", fullmatch=True)
_piece_text = st.lists(
    st.one_of(_word, st.just(" "), st.just(" "), st.sampled_from(_PIECES), st.text(st.characters(codec="utf-8"),
                                                                                    max_size=4)),
    max_size=40,
).map("".join)


@pytest.mark.parametrize("which", ["fastokens", "tiktoken", "hf"])
@_SETTINGS
@given(content=_piece_text, piece_chars=st.integers(1, 12))
def test_pieces_tokenize_as_the_whole(which: str, content: str, piece_chars: int, bundle: TokenizerBundle,
                                      reference: ReferencePromptEncoder, request: pytest.FixtureRequest) -> None:
    plain = request.getfixturevalue(f"{which}_encoder").plain
    encoder = PromptEncoder(bundle, plain=plain, piece_chars=piece_chars)
    conv = _convert(dr.ChatCompletionRequest, {"model": MODEL, "messages": [{"role": "user", "content": content}]})
    event(f"cut: {len(list(pieces(content, piece_chars))) > 1}")
    assert encoder.encode(conv) == reference.encode(conv)


def test_pieces_cut_only_before_a_space_between_letters() -> None:
    text = "ab cd,ef 12 gh ij"
    assert list(pieces(text, 1)) == ["ab", " cd,ef 12 gh", " ij"]
    assert "".join(pieces(text, 1)) == text
    assert list(pieces(text, 100)) == [text]
    assert list(pieces("中文" * 50, 4)) == ["中文" * 50]  # no word space: one piece


def test_long_message_sharing_a_prefix_retokenizes_only_its_tail(bundle: TokenizerBundle,
                                                                 fastokens_encoder: PromptEncoder,
                                                                 reference: ReferencePromptEncoder) -> None:
    encoder = PromptEncoder(bundle, plain=fastokens_encoder.plain, piece_chars=1000)
    document = " ".join(f"word{i % 7} text" for i in range(10_000))  # ~100k characters, one message

    def ask(question: str) -> list[int]:
        conv = _convert(dr.ChatCompletionRequest,
                        {"model": MODEL, "messages": [{"role": "user", "content": document + question}]})
        ids = encoder.encode(conv)
        assert ids == reference.encode(conv)
        return ids

    ask(" first question")
    before = encoder.cache_stats()
    ask(" second question")
    after = encoder.cache_stats()
    assert after.hits - before.hits >= 90  # the document's pieces
    assert after.misses - before.misses <= 2  # the last piece (with the new question), the thinking tail


def test_unrecognised_pre_tokenizer_is_never_cut(bundle: TokenizerBundle) -> None:
    data = json.loads(bundle.json_text)
    data["pre_tokenizer"] = {"type": "Whitespace"}
    plain = HfPlain(data)
    assert not plain.cuts_at_word_spaces
    encoder = PromptEncoder(bundle, plain=plain, piece_chars=4)
    message = {"role": "user", "content": "ab cd " * 20}
    encoder.encode(_convert(dr.ChatCompletionRequest, {"model": MODEL, "messages": [message]}))
    assert encoder.cache_stats().hits == 0  # cut, the message's repeated pieces would hit each other
