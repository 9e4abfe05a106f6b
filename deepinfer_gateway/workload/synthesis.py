"""Prompt synthesis: trace block ids -> prompt text whose token blocks follow the ids.

Guarantee (verified by tests with the real tokenizer): the prompt's user content
tokenizes to exactly `input_length` tokens, block i of the request being exactly the
tokens of `block_text(hash_ids[i])` (`block_size` tokens, the last block possibly
shorter), so

- equal hash ids give identical token blocks at the same positions, and
- distinct hash ids give distinct token blocks (see the caveat on tiny partial blocks).

How: a vocabulary of words `w` for which " w" is one token of the tokenizer. A block is
`block_size` such space-prefixed words. The tokenizer's pre-tokenizer splits text into
space-prefixed letter runs before BPE, so no merge can cross a word (or a block)
boundary, and the token ids are known without tokenizing. The first three words of a
block spell a unique number for its id (base = vocabulary size, ~22k), the rest are
drawn from a PRNG seeded by the id, so text is deterministic per id across runs and
machines (for the same tokenizer). A partial last block is the prefix of its id's full
block; partial blocks shorter than three tokens may coincide for different ids.

Requests without prefix information (Azure traces) get blocks of their own, never
shared with any other request.

On the wire, the prompt is one user message, so the chat template adds a fixed header
before the content (28 tokens with the DeepSeek-V4.1 template and the default
tokenizer: BOS, <｜System｜>, the reasoning-effort line, <｜User｜>) and 2 tokens after it.
The header is the same for every request; block i of the trace covers prompt positions
[28 + 512 i, 28 + 512 (i + 1)). Prompt tokens reported by the server are therefore
input_length + 30.
"""

from __future__ import annotations

import random
import re
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import orjson

from deepinfer_gateway.workload.types import MOONCAKE_BLOCK_TOKENS, TraceRequest

_WORD = re.compile(r"Ġ([a-z]{3,9})")
_ID_DIGITS = 3
_UNIQUE_STRIDE = 1 << 20  # blocks per request in the no-prefix-info namespace


@dataclass(frozen=True)
class Vocabulary:
    """Words whose space-prefixed form is exactly one token, and those token ids."""

    words: tuple[str, ...]  # each stored with its leading space
    token_ids: tuple[int, ...]

    @classmethod
    def from_tokenizer(cls, tokenizer: object, tokenizer_json: str) -> Vocabulary:
        vocab = orjson.loads(tokenizer_json)["model"]["vocab"]
        words, ids = [], []
        for piece, token_id in sorted(vocab.items()):
            m = _WORD.fullmatch(piece)
            if m and tokenizer.encode(" " + m.group(1)) == [token_id]:  # type: ignore[attr-defined]
                words.append(" " + m.group(1))
                ids.append(token_id)
        if len(words) < 1000:
            raise ValueError(f"tokenizer has only {len(words)} single-token words; prompt synthesis needs 1000")
        return cls(tuple(words), tuple(ids))


class PromptSynthesizer:
    def __init__(self, vocabulary: Vocabulary, block_size: int = MOONCAKE_BLOCK_TOKENS,
                 salt: str = "dgw-bench-v1", cache_blocks: int = 16384):
        if block_size < _ID_DIGITS:
            raise ValueError("block_size too small")
        self.vocabulary = vocabulary
        self.block_size = block_size
        self.salt = salt
        self._base = len(vocabulary.words)
        self._words = list(vocabulary.words)
        self._token_ids = np.asarray(vocabulary.token_ids, dtype=np.int64)
        self._texts: OrderedDict[int, str] = OrderedDict()  # full-block text per block number (LRU)
        self._cache_blocks = cache_blocks

    @classmethod
    def for_default_tokenizer(cls, block_size: int = MOONCAKE_BLOCK_TOKENS) -> PromptSynthesizer:
        from deepinfer_gateway.recipe_bridge.tokenizer import load_tokenizer

        bundle = load_tokenizer()
        return cls(Vocabulary.from_tokenizer(bundle.tokenizer, bundle.json_text), block_size)

    # --- blocks -------------------------------------------------------------------
    def _indices(self, number: int) -> np.ndarray:
        """Word indices of the full block numbered `number`: id digits, then seeded PRNG words."""
        if number >= self._base ** _ID_DIGITS:
            raise ValueError(f"block number {number} too large for a {self._base}-word vocabulary")
        digits, n = [], number
        for _ in range(_ID_DIGITS):
            n, d = divmod(n, self._base)
            digits.append(d)
        tail = random.Random(f"{self.salt}:{number}").randbytes(4 * (self.block_size - _ID_DIGITS))
        rest = np.frombuffer(tail, dtype="<u4") % self._base
        return np.concatenate([np.asarray(digits, dtype=np.int64), rest.astype(np.int64)])

    def _text(self, number: int, tokens: int) -> str:
        if tokens < self.block_size:
            return "".join(self._words[i] for i in self._indices(number)[:tokens].tolist())
        text = self._texts.get(number)
        if text is None:
            text = "".join(self._words[i] for i in self._indices(number).tolist())
            self._texts[number] = text
            if len(self._texts) > self._cache_blocks:
                self._texts.popitem(last=False)
        else:
            self._texts.move_to_end(number)
        return text

    def _block_numbers(self, request: TraceRequest) -> list[tuple[int, int]]:
        """(block number, tokens) per block of the request's content."""
        n_blocks = -(-request.input_length // self.block_size)
        ids = list(request.hash_ids or ())[:n_blocks]
        numbers = [2 * int(i) for i in ids]
        # Blocks without an id (no prefix info, or fewer ids than blocks): private blocks.
        numbers += [2 * (request.index * _UNIQUE_STRIDE + b) + 1 for b in range(len(ids), n_blocks)]
        sizes = [self.block_size] * n_blocks
        if n_blocks:
            sizes[-1] = request.input_length - self.block_size * (n_blocks - 1)
        return list(zip(numbers, sizes, strict=True))

    # --- public ---------------------------------------------------------------------
    def block_text(self, hash_id: int, tokens: int | None = None) -> str:
        return self._text(2 * hash_id, tokens or self.block_size)

    def content(self, request: TraceRequest) -> str:
        """The user message text: exactly `input_length` tokens."""
        return "".join(self._text(number, size) for number, size in self._block_numbers(request))

    def content_token_ids(self, request: TraceRequest) -> list[int]:
        """The token ids `content(request)` tokenizes to (known without tokenizing)."""
        parts = [self._token_ids[self._indices(number)[:size]] for number, size in self._block_numbers(request)]
        return np.concatenate(parts).tolist() if parts else []
