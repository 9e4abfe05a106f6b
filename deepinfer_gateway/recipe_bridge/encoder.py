"""Prompt encoding: Conversation -> token ids, with deepseek-recipe's V4.1 template.

`PromptEncoder` makes a follow-up turn pay only for what is new:

1. Render with deepseek-recipe (`render_conversation`: prompt text + the code-point
   ranges of the special tokens it placed; cheap, ~1 ms per 500 kB).
2. Cut the prompt at the special ranges. A special range becomes its id from the
   tokenizer's added vocabulary (`<｜image｜>` placeholders included: one id each,
   exactly as `encode` emits them).
3. Each plain-text segment between two specials is looked up in a `SegmentCache`
   (exact key: the text; optionally its SHA-256 when long); only misses are tokenized, with
   the fastest exact plain-text tokenizer (`segment_tokenizer.plain_tokenizer`:
   fastokens, else tiktoken with DeepSeek's ranks, else deepseek-recipe's Tokenizer
   without the added vocabulary).

Exactness: deepseek-recipe's `encode` tokenizes every stretch between special ranges
independently, as plain text (no added-vocabulary matching), so concatenating
per-segment ids with the special ids reproduces it token for token. Every message is
delimited by special tokens (`<｜User｜>`, `<｜Assistant｜>`, `<｜end▁of▁sentence｜>`,
`<think>`...), so earlier turns are separate segments and hit the cache; the changed
tail (last user message, tool result) is tokenized afresh.

Long segments are cached in pieces of ~`piece_chars` characters, cut before a space
between two ASCII letters ("...word| word..."): DeepSeek's pre-tokenizer ends a letter
run at that space and starts the " word" piece there whatever precedes it, so the pieces
tokenize exactly as the whole (only where the plain tokenizer says its pre-tokenizer is
DeepSeek's: `cuts_at_word_spaces`). Cuts are the first such space at or after each
multiple of `piece_chars` from the segment's start, so one message that shares a prefix
with an earlier one (a long document re-sent with a new question, a message grown by
appending, a trace's shared prefix blocks) re-tokenizes only from the piece where they
differ. Text without such spaces (CJK, long symbol runs) stays one segment.

Cost per call: render + reading `special_ranges` (~1.7 ms for a 520k-character prompt:
the library converts byte to code-point offsets) + O(prompt length) slicing/keying
(~1 ms) + tokenizing the misses only, all of them in one call (fastokens' batch encode
straight to packed uint32 words, ~20 ns/token) + joining the segments' packed words.
The ids are those words (`kvcache.packed_ids.PackedIds`: no int object per token unless
something iterates them; JSON to the worker is written from the words). The cache holds
packed words only: a cached token costs 4 bytes, where joining cached ids or gathering
shared int objects touched each int's refcount at a random address (~130 ns/token with
the CPU caches cold, as they are between requests). Figures: bench/preprocess.py
(`--baseline` runs the pre-change tree side by side, `--cold-caches` also cold). Memory:
the cache is bounded by `cache_bytes` (default 256 MiB, ~9 B per cached token with text
keys; see segment_cache.py).

`encode_packed` also returns the prompt packed, for block hashing.

`ReferencePromptEncoder` is deepseek-recipe's own `encode`: the baseline the fast path
is tested against (tests/unit/test_encoder.py) and benchmarked against (bench/preprocess.py).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import deepseek_recipe as dr

from deepinfer_gateway.kvcache.hashing import pack_tokens
from deepinfer_gateway.kvcache.packed_ids import PackedIds, unpacked
from deepinfer_gateway.recipe_bridge.segment_cache import (
    DEFAULT_DIGEST_MIN_CHARS,
    CacheStats,
    SegmentCache,
    SegmentKey,
)
from deepinfer_gateway.recipe_bridge.segment_tokenizer import (
    PlainTokenizer,
    plain_tokenizer,
)
from deepinfer_gateway.recipe_bridge.tokenizer import TokenizerBundle

DEFAULT_CACHE_BYTES = 256 * 1024 * 1024
# ~1.5-2k tokens of English: a changed piece re-tokenizes in ~0.6 ms, and a 100k-token
# message is ~60 cache entries.
DEFAULT_PIECE_CHARS = 8192
_WORD_SPACE = re.compile(r"(?<=[A-Za-z]) (?=[A-Za-z])")


def pieces(text: str, piece_chars: int) -> Iterator[str]:
    """`text` cut before the first word space at or after each `piece_chars` from its start."""
    start = 0
    while len(text) - start > piece_chars:
        cut = _WORD_SPACE.search(text, start + piece_chars)
        if cut is None:
            break
        yield text[start:cut.start()]
        start = cut.start()
    yield text[start:]


_PENDING = b""  # a miss's place until the misses are tokenized


class _Work(NamedTuple):
    """One prompt's encoding in progress."""
    segments: list[bytes]  # each segment's packed words, in prompt order; misses are `_PENDING`
    pending: list[tuple[int, SegmentKey]]  # (index in segments, key) of each miss
    misses: dict[SegmentKey, str]  # key -> text, each distinct miss once


class EncodedPrompt(NamedTuple):
    token_ids: Sequence[int]  # PackedIds(packed) from PromptEncoder, a list from the reference
    packed: bytes  # kvcache.hashing.pack_tokens(token_ids)


class ReferencePromptEncoder:
    """deepseek-recipe's own prompt encoding, uncached."""

    def __init__(self, bundle: TokenizerBundle):
        self.bundle = bundle
        self._encoding = dr.DeepseekV41Encoding().with_tokenizer(bundle.tokenizer)

    def encode(self, conversation: dr.Conversation) -> list[int]:
        return self._encoding.encode(conversation)

    def encode_packed(self, conversation: dr.Conversation) -> EncodedPrompt:
        ids = self.encode(conversation)
        return EncodedPrompt(ids, pack_tokens(ids))


class PromptEncoder:
    """Segment-cached prompt encoding; token-exact with `ReferencePromptEncoder`."""

    def __init__(
        self,
        bundle: TokenizerBundle,
        *,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        digest_min_chars: int | None = DEFAULT_DIGEST_MIN_CHARS,
        plain: PlainTokenizer | None = None,
        piece_chars: int = DEFAULT_PIECE_CHARS,
    ):
        self.bundle = bundle
        self._render = dr.DeepseekV41Encoding().render_conversation
        self.plain = plain or plain_tokenizer(bundle.json_text)
        self._special = {content: pack_tokens([token_id]) for content, token_id in bundle.added_tokens.items()}
        self.cache = SegmentCache(cache_bytes, digest_min_chars=digest_min_chars)
        # 0 (asked, or a tokenizer whose pre-tokenizer may merge across a word space): never cut
        self._piece_chars = piece_chars if self.plain.cuts_at_word_spaces else 0

    def encode(self, conversation: dr.Conversation) -> list[int]:
        return unpacked(self.encode_packed(conversation).packed)

    def encode_packed(self, conversation: dr.Conversation) -> EncodedPrompt:
        rendered = self._render(conversation)
        prompt = rendered.prompt
        special = self._special
        work = _Work([], [], {})
        pos = 0
        for start, end in rendered.special_ranges:
            if start > pos:
                self._add_text(work, prompt[pos:start])
            spelling = prompt[start:end]
            segment = special.get(spelling)
            if segment is None:  # same failure as deepseek-recipe's encode
                raise RuntimeError(f"special token {spelling!r} is not in the added vocabulary")
            work.segments.append(segment)
            pos = end
        if pos < len(prompt):
            self._add_text(work, prompt[pos:])
        segments = work.segments
        if work.misses:
            packs = self.plain.encode_packed(list(work.misses.values()))  # all misses in one call
            made = dict(zip(work.misses, packs, strict=True))
            for index, key in work.pending:
                segments[index] = made[key]
            for key, piece in made.items():  # a text repeated within the prompt is cached once
                self.cache.put(key, piece)
        packed = b"".join(segments)
        return EncodedPrompt(PackedIds(packed), packed)

    def _add_text(self, work: _Work, text: str) -> None:
        if self._piece_chars and len(text) > self._piece_chars:
            for piece in pieces(text, self._piece_chars):
                self._lookup(work, piece)
        else:
            self._lookup(work, text)

    def _lookup(self, work: _Work, text: str) -> None:
        cache = self.cache
        key = cache.key(text)
        segment = cache.get(key) if key not in work.misses else None
        if segment is None:
            work.misses[key] = text
            work.pending.append((len(work.segments), key))
            segment = _PENDING
        work.segments.append(segment)

    def cache_stats(self) -> CacheStats:
        return self.cache.stats()
