"""Streamed text -> the gateway's token ids, for upstreams that answer in text (openai_upstream.py)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import lru_cache

from deepinfer_gateway.recipe_bridge.segment_tokenizer import (
    FastokensPlain,
    fastokens_with_added_vocabulary,
    plain_tokenizer,
)
from deepinfer_gateway.recipe_bridge.tokenizer import TokenizerBundle

log = logging.getLogger(__name__)

_EAGER_CHARS = 64  # text without whitespace is held back at most this long


class TextTokens:
    """Streamed text -> token ids, incrementally, with the gateway's tokenizer.

    Text is encoded up to the start of its last whitespace run (BPE pre-tokens begin there,
    so the ids match encoding the whole text), never cutting through a special token's
    spelling (`<think>`, `｜DSML｜` arriving in pieces): those must come out as their ids,
    which the response path parses. `eager` pushes encode everything but such a spelling.
    """

    def __init__(self, bundle: TokenizerBundle):
        self._encode = text_encoder(bundle)
        self._prefixes, self._longest = _special_prefixes(bundle.json_text, tuple(bundle.added_tokens))
        self._special_ids = frozenset(bundle.added_tokens.values())
        self._pending = ""

    def push(self, text: str, *, eager: bool = False) -> list[int]:
        pending = self._pending + text
        cut = len(pending) if eager or len(pending) > _EAGER_CHARS else self._word_cut(pending)
        ids = self._encode(pending[:cut]) if cut else []
        if ids and ids[-1] not in self._special_ids:  # (text ending in a whole spelling is done)
            held = self._special_start(pending, cut)
            if held:
                cut -= held
                ids = self._encode(pending[:cut]) if cut else []
        self._pending = pending[cut:]
        return ids

    def flush(self) -> list[int]:
        pending, self._pending = self._pending, ""
        return self._encode(pending) if pending else []

    @staticmethod
    def _word_cut(text: str) -> int:
        """The start of the last whitespace run (0: none)."""
        i = len(text)
        while i and not text[i - 1].isspace():
            i -= 1
        while i and text[i - 1].isspace():
            i -= 1
        return i

    def _special_start(self, text: str, cut: int) -> int:
        """The length of the longest end of `text[:cut]` that may begin a special token's spelling."""
        for k in range(min(self._longest, cut), 0, -1):
            if text[cut - k:cut] in self._prefixes:
                return k
        return 0


@lru_cache(maxsize=2)
def _special_prefixes(_json_text: str, spellings: tuple[str, ...]) -> tuple[frozenset[str], int]:
    """The proper prefixes of the added tokens' spellings, and the longest spelling (once per vocabulary)."""
    prefixes = frozenset(s[:k] for s in spellings for k in range(1, len(s)))
    return prefixes, max((len(s) for s in spellings), default=1)


_TEXT_ENCODERS: dict[str, Callable[[str], list[int]]] = {}


def text_encoder(bundle: TokenizerBundle) -> Callable[[str], list[int]]:
    """Text -> ids with the added vocabulary matched, exactly as `bundle.tokenizer.encode`:
    fastokens where it is the plain tokenizer and agrees on every added token's spelling
    (~15x faster), else the bundle's own tokenizer. Chosen, and logged, once per vocabulary."""
    encode = _TEXT_ENCODERS.get(bundle.json_text)
    if encode is None:
        encode, reason = _choose(bundle)
        log.info("streamed-text tokenizer: %s", reason)
        _TEXT_ENCODERS[bundle.json_text] = encode
    return encode


def _choose(bundle: TokenizerBundle) -> tuple[Callable[[str], list[int]], str]:
    plain = plain_tokenizer(bundle.json_text)
    if not isinstance(plain, FastokensPlain):
        return bundle.tokenizer.encode, f"the vocabulary's own tokenizer (plain tokenizer: {plain.name})"
    encode = fastokens_with_added_vocabulary(bundle.json_text)
    sample = "x ".join(f" {s}{s}a{s}\n{s} " for s in bundle.added_tokens) + " plain 123 中文"
    if encode(sample) != bundle.tokenizer.encode(sample):
        return bundle.tokenizer.encode, "the vocabulary's own tokenizer (fastokens differed on added tokens)"
    return encode, f"{plain.name}, added vocabulary matched (self-check passed)"
