"""Plain-text tokenizers: fastokens and tiktoken with DeepSeek's ranks == the reference (deepseek-recipe's
Tokenizer from the same tokenizer.json, added vocabulary removed), token for token, on adversarial text."""

from __future__ import annotations

import json
import unicodedata

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from deepinfer_gateway.kvcache.hashing import pack_tokens
from deepinfer_gateway.recipe_bridge.segment_tokenizer import (
    FastokensPlain,
    HfPlain,
    PlainTokenizer,
    TiktokenPlain,
    choose_plain_tokenizer,
    plain_tokenizer,
)
from deepinfer_gateway.recipe_bridge.tokenizer import load_tokenizer

FAST = ["fastokens", "tiktoken"]


@pytest.fixture(scope="module")
def reference() -> HfPlain:
    return HfPlain(json.loads(load_tokenizer().json_text))


@pytest.fixture(scope="module")
def fastokens_plain() -> PlainTokenizer:
    plain = plain_tokenizer(load_tokenizer().json_text)
    assert isinstance(plain, FastokensPlain)  # the default tokenizer.json is recognised
    return plain


@pytest.fixture(scope="module")
def tiktoken_plain() -> PlainTokenizer:
    plain = plain_tokenizer(load_tokenizer().json_text, prefer="tiktoken")
    assert isinstance(plain, TiktokenPlain)
    return plain


@pytest.fixture(params=FAST)
def fast(request: pytest.FixtureRequest) -> PlainTokenizer:
    return request.getfixturevalue(f"{request.param}_plain")


# --- adversarial text ------------------------------------------------------------------------

# Every Unicode general category but Cs (surrogates: tested apart, no UTF-8 spelling).
CATEGORIES = ["Lu", "Ll", "Lt", "Lm", "Lo", "Mn", "Mc", "Me", "Nd", "Nl", "No", "Pc", "Pd", "Ps", "Pe", "Pi",
              "Pf", "Po", "Sm", "Sc", "Sk", "So", "Zs", "Zl", "Zp", "Cc", "Cf", "Co", "Cn"]
_SPECIALS = sorted({t["content"] for t in json.loads(load_tokenizer().json_text)["added_tokens"]})
_SCRIPTS = st.sampled_from([
    " ", "  ", "\n", "\r\n", "\t", "\u3000", "\u00a0", "7", "123456", "١٢٣", "一二", "ひらがな", "カタカナー", "・",
    "゛", "゠", "한", "e\u0301", "\u0301", "👨\u200d👩", "🎉\ufe0f", "\x00", "\u200b", "\ue000", "x1y", "...", "?!",
    "$", "、", "。", "Ab", "ẞ", "ǅ", "Ⅻ", "½", "'s", "'S", "\u2028", "\u2029", "\x85",
])
# The edges of DeepSeek's CJK split (一-龥, hiragana, katakana) and their neighbours.
_CJK_EDGES = "\u4dff\u4e00\u9fa5\u9fa6\u303f\u3040\u309f\u30a0\u30ff\u3100\u31f0\uff66\uf900"
_whitespace = st.text(st.sampled_from(" \t\n\r\x0b\x0c\u3000\u00a0\u2003\u200b\x85"), min_size=1, max_size=12)
_digit_run = st.builds(lambda n, d: (d * n)[:n], st.integers(1, 40), st.sampled_from(["7", "12", "٣", "１", "²", "Ⅻ"]))
_piece = st.one_of(
    _SCRIPTS,
    st.sampled_from(_SPECIALS),
    st.text(st.sampled_from(_CJK_EDGES + "ab 1"), max_size=6),
    _whitespace,
    _digit_run,
    st.sampled_from(CATEGORIES).flatmap(lambda c: st.text(st.characters(categories=[c]), min_size=1, max_size=4)),
    st.text(st.characters(codec="utf-8"), max_size=6),
)
adversarial = st.lists(_piece, max_size=24).map("".join)

_SETTINGS = settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("which", FAST)
@_SETTINGS
@given(text=adversarial)
def test_matches_reference_on_adversarial_text(which: str, text: str, reference: HfPlain,
                                               request: pytest.FixtureRequest) -> None:
    fast = request.getfixturevalue(f"{which}_plain")
    expected = reference.encode(text)
    assert fast.encode(text) == expected
    assert fast.encode_packed([text, "", text + "1"]) == [pack_tokens(expected), b"",
                                                          pack_tokens(reference.encode(text + "1"))]


@pytest.mark.parametrize("which", FAST)
@settings(max_examples=300, deadline=None)
@given(category=st.sampled_from(CATEGORIES), data=st.data())
def test_every_general_category_alone_and_between_words(which: str, category: str, data: st.DataObject,
                                                       reference: HfPlain, request: pytest.FixtureRequest) -> None:
    fast = request.getfixturevalue(f"{which}_plain")
    chars = data.draw(st.text(st.characters(categories=[category]), min_size=1, max_size=8))
    event(category)
    assert all(unicodedata.category(c) == category for c in chars)
    for text in (chars, f"a{chars}b", f" {chars} ", f"1{chars}中", f"{chars}\n", f"x {chars}{chars} 12"):
        assert fast.encode(text) == reference.encode(text)


@pytest.mark.parametrize("which", FAST)
@settings(max_examples=300, deadline=None)
@given(spaces=_whitespace, newlines=st.text(st.sampled_from("\n\r"), max_size=3), word=st.sampled_from(
    ["", "a", "中", "1", "!", "<think>", "\u0301"]))
def test_whitespace_runs_with_and_without_trailing_newlines(which: str, spaces: str, newlines: str, word: str,
                                                          reference: HfPlain, request: pytest.FixtureRequest) -> None:
    fast = request.getfixturevalue(f"{which}_plain")
    for text in (spaces + newlines, word + spaces + newlines, spaces + newlines + word, word + spaces + word):
        assert fast.encode(text) == reference.encode(text)


def test_digit_runs_of_every_length(fast: PlainTokenizer, reference: HfPlain) -> None:
    for digit in ("7", "٣", "１", "²", "Ⅻ", "1٣"):
        for n in range(1, 66):
            for text in ((digit * n)[:n], f"a{(digit * n)[:n]}b", f" {(digit * n)[:n]}\n", f"中{(digit * n)[:n]}カ"):
                assert fast.encode(text) == reference.encode(text), text


def test_special_token_spellings_stay_plain_text(fast: PlainTokenizer, reference: HfPlain) -> None:
    """Every added token's spelling, alone and glued to text, tokenizes as plain text (no added id)."""
    added_ids = set(load_tokenizer().added_tokens.values())
    for spelling in _SPECIALS:
        for text in (spelling, f"a{spelling}b", f" {spelling}\n", spelling * 2, spelling[:-1]):
            ids = fast.encode(text)
            assert ids == reference.encode(text), text
            assert not added_ids & set(ids)
            assert fast.encode_packed([text]) == [pack_tokens(ids)]


def test_cjk_kana_boundaries(fast: PlainTokenizer, reference: HfPlain) -> None:
    for a in _CJK_EDGES + "a 1、ー":
        for b in _CJK_EDGES + "a 1、ー":
            text = f"{a}{b}{a}"
            assert fast.encode(text) == reference.encode(text), text


def test_long_runs_match(fast: PlainTokenizer, reference: HfPlain) -> None:
    for text in ("a" * 20_000, " " * 20_000, "1" * 20_000, "中" * 20_000, "ab\n" * 5_000, " \n" * 5_000):
        assert fast.encode(text) == reference.encode(text)


@given(text=st.text(st.characters(codec="utf-8"), max_size=6), surrogate=st.characters(categories=["Cs"]),
       at=st.integers(0, 6))
@settings(max_examples=200, deadline=None)
def test_lone_surrogates_fail_like_the_reference(fastokens_plain: PlainTokenizer, reference: HfPlain, text: str,
                                                 surrogate: str, at: int) -> None:
    """No UTF-8 spelling: both refuse (the request path never gets here: JSON parsers reject them).
    tiktoken instead encodes U+FFFD, the one known difference of the tiktoken fallback."""
    bad = text[:at] + surrogate + text[at:]
    with pytest.raises(UnicodeEncodeError):
        reference.encode(bad)
    with pytest.raises(UnicodeEncodeError):
        fastokens_plain.encode(bad)


def test_unrecognised_pre_tokenizer_falls_back_to_hf() -> None:
    data = json.loads(load_tokenizer().json_text)
    data["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "\\p{N}{1,2}"
    choice = choose_plain_tokenizer(json.dumps(data))
    assert isinstance(choice.tokenizer, HfPlain)
    assert "not DeepSeek's" in choice.reason


def test_choice_says_why() -> None:
    text = load_tokenizer().json_text
    fast = choose_plain_tokenizer(text)
    assert isinstance(fast.tokenizer, FastokensPlain) and "self-check passed" in fast.reason
    tik = choose_plain_tokenizer(text, "tiktoken")
    assert isinstance(tik.tokenizer, TiktokenPlain) and "fastokens not asked for" in tik.reason


def test_reference_can_be_asked_for() -> None:
    assert isinstance(plain_tokenizer(load_tokenizer().json_text, prefer="hf"), HfPlain)
