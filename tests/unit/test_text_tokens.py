"""TextTokens: streamed text re-tokenized piece by piece gives back the text, with every
special token's spelling (even one split across pieces) as that token's id."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepinfer_gateway.gateway.upstream.text_tokens import TextTokens, text_encoder
from deepinfer_gateway.recipe_bridge.detokenizer import token_bytes
from deepinfer_gateway.recipe_bridge.segment_tokenizer import FastokensPlain, plain_tokenizer
from deepinfer_gateway.recipe_bridge.tokenizer import load_tokenizer
from tests.unit.test_encoder_plain import adversarial

TEXT = ('Let me think. Hello world, 12345 foo!</think>\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="get_weather">\n'
        '<｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n'
        '</｜DSML｜ calls> 中文文本测试很长的一段没有空格的文字，'
        '再来一些没有空格的文字直到超过六十四个字符为止好吗好的')


@pytest.mark.parametrize("seed", range(20))
def test_pieces_give_back_the_text_and_the_special_ids(seed: int) -> None:
    bundle = load_tokenizer(None)
    whole = bundle.tokenizer.encode(TEXT)
    rng = random.Random(seed)
    tokens, ids, i = TextTokens(bundle), [], 0
    while i < len(TEXT):
        n = rng.randint(1, 7)
        ids += tokens.push(TEXT[i:i + n], eager=i == 0)
        i += n
    ids += tokens.flush()
    assert token_bytes(bundle.json_text).decode(ids) == TEXT
    for special in ("｜DSML｜", "</think>"):
        token = bundle.special_token_id(special)
        assert ids.count(token) == whole.count(token) > 0
    assert abs(len(ids) - len(whole)) <= len(whole) // 5  # a re-tokenization: close to, not always, the same


def test_text_is_held_back_only_to_a_word_boundary() -> None:
    encode = load_tokenizer(None).tokenizer.encode
    tokens = TextTokens(load_tokenizer(None))
    assert tokens.push("Hello wor") == encode("Hello")
    assert tokens.push("ld<｜DS") == []  # " world" may go on; "<｜DS" may be a special token
    assert tokens.push("ML｜ x") == encode(" world<｜DSML｜")
    assert tokens.flush() == encode(" x")


_ADDED = sorted(load_tokenizer(None).added_tokens)


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=st.lists(st.one_of(st.sampled_from(_ADDED), adversarial), max_size=8).map("".join))
def test_text_encoder_matches_the_vocabulary_tokenizer(text: str) -> None:
    """The streamed-text encoder (added tokens matched in Python, fastokens between) == deepseek-recipe's Tokenizer."""
    bundle = load_tokenizer(None)
    assert text_encoder(bundle)(text) == bundle.tokenizer.encode(text)


def test_text_encoder_is_fastokens_for_the_default_vocabulary() -> None:
    bundle = load_tokenizer(None)
    assert isinstance(plain_tokenizer(bundle.json_text), FastokensPlain)
    assert text_encoder(bundle) is not bundle.tokenizer.encode
