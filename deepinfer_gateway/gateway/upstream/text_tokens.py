"""Streamed text -> the gateway's token ids, for upstreams that answer in text (openai.py)."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from functools import lru_cache

from deepinfer_gateway.recipe_bridge.segment_tokenizer import (
    FastokensPlain,
    PlainTokenizer,
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
    encode = _added_then_plain(plain, json.loads(bundle.json_text)["added_tokens"])
    sample = "x ".join(f" {s}{s}a{s}\n{s} " for s in bundle.added_tokens) + " plain 123 中文"
    if encode is None or encode(sample) != bundle.tokenizer.encode(sample):
        return bundle.tokenizer.encode, "the vocabulary's own tokenizer (added tokens not matched as modelled here)"
    return encode, f"added tokens matched here, the text between them by {plain.name} (self-check passed)"


def _added_then_plain(plain: PlainTokenizer, added: list[dict[str, object]]) -> Callable[[str], list[int]] | None:
    """Hugging Face tokenizers' added-vocabulary matching, for a tokenizer.json without a
    normalizer (the plain tokenizer only exists for those): leftmost-longest over the
    tokens with `normalized: false`, then over the `normalized: true` ones within the
    stretches left, the text between by the plain tokenizer. None when a token asks for
    stripping or whole-word matching (not modelled)."""
    if any(t.get("lstrip") or t.get("rstrip") or t.get("single_word") for t in added):
        return None
    ids = {str(t["content"]): int(str(t["id"])) for t in added}

    def alternation(normalized: bool) -> re.Pattern[str] | None:
        spellings = sorted((str(t["content"]) for t in added if bool(t.get("normalized")) == normalized),
                           key=len, reverse=True)  # longest first: leftmost-longest
        return re.compile("|".join(map(re.escape, spellings))) if spellings else None

    def split(pattern: re.Pattern[str] | None, text: str, inner: Callable[[str, list[int]], None],
              out: list[int]) -> None:
        pos = 0
        if pattern is not None:
            for match in pattern.finditer(text):
                if match.start() > pos:
                    inner(text[pos:match.start()], out)
                out.append(ids[match.group()])
                pos = match.end()
        if pos < len(text):
            inner(text[pos:], out)

    first, second = alternation(False), alternation(True)

    def plain_part(text: str, out: list[int]) -> None:
        out += plain.encode(text)

    def normalized_part(text: str, out: list[int]) -> None:
        split(second, text, plain_part, out)

    def encode(text: str) -> list[int]:
        out: list[int] = []
        split(first, text, normalized_part, out)
        return out

    return encode
