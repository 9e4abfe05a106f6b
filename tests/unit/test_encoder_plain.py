"""Plain-text tokenizers: tiktoken with DeepSeek's ranks == the HF tokenizer without added vocabulary."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer_gateway.recipe_bridge.segment_tokenizer import (
    HfPlain,
    TiktokenPlain,
    plain_tokenizer,
)
from deepinfer_gateway.recipe_bridge.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def pair() -> tuple[TiktokenPlain, HfPlain]:
    text = load_tokenizer().json_text
    fast = plain_tokenizer(text)
    assert isinstance(fast, TiktokenPlain)
    return fast, HfPlain(json.loads(text))


_SCRIPTS = st.sampled_from([
    " ", "  ", "\n", "\r\n", "\t", "\u3000", "\u00a0", "7", "123456", "١٢٣", "一二", "ひらがな", "カタカナー", "・",
    "゛", "゠", "한", "e\u0301", "\u0301", "👨\u200d👩", "🎉\ufe0f", "\x00", "\u200b", "\ue000", "<｜User｜>",
    "<think>", "x1y", "...", "?!", "$", "、", "。", "Ab", "ẞ", "ǅ", "Ⅻ", "½",
])
_text = st.lists(st.one_of(_SCRIPTS, st.text(st.characters(codec="utf-8"), max_size=6)), max_size=20).map("".join)


@settings(max_examples=1000, deadline=None)
@given(text=_text)
def test_tiktoken_matches_hf_without_added_vocabulary(pair: tuple[TiktokenPlain, HfPlain], text: str) -> None:
    fast, reference = pair
    assert fast.encode(text) == reference.encode(text)


def test_long_runs_match(pair: tuple[TiktokenPlain, HfPlain]) -> None:
    fast, reference = pair
    for text in ("a" * 20_000, " " * 20_000, "1" * 20_000, "中" * 20_000, "ab\n" * 5_000):
        assert fast.encode(text) == reference.encode(text)


def test_unrecognised_pre_tokenizer_falls_back_to_hf() -> None:
    data = json.loads(load_tokenizer().json_text)
    data["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "\\p{N}{1,2}"
    assert isinstance(plain_tokenizer(json.dumps(data)), HfPlain)


def test_tiktoken_can_be_declined() -> None:
    assert isinstance(plain_tokenizer(load_tokenizer().json_text, prefer_tiktoken=False), HfPlain)
