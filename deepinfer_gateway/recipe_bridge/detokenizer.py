"""Token ids -> text for the legacy Completions API (deepseek-recipe's Tokenizer only encodes).

`TokenBytes` maps every id of a byte-level BPE `tokenizer.json` to its bytes (GPT-2's
printable byte alphabet undone; added tokens are their literal text). `TextDecoder` is
the incremental form: feed ids, get the text that is complete so far; a UTF-8 sequence
split across tokens is held back until its last byte arrives (`flush()` ends the stream,
replacing an unfinished sequence with U+FFFD). Building `TokenBytes` costs ~0.3 s, so one
is kept per vocabulary, and its table in `derived_cache` for the next start.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Sequence
from functools import lru_cache

from deepinfer_gateway.recipe_bridge import derived_cache


def byte_alphabet() -> dict[str, int]:
    """GPT-2 `bytes_to_unicode`, inverted: printable char -> byte (byte-level BPE pieces)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def _pieces(tokenizer_json: str) -> dict[int, bytes]:
    data = json.loads(tokenizer_json)
    alphabet = byte_alphabet()
    pieces = {int(i): bytes(alphabet.get(ch, 0x3F) for ch in piece) for piece, i in data["model"]["vocab"].items()}
    for token in data["added_tokens"]:
        pieces[int(token["id"])] = token["content"].encode()
    return pieces


def _cached_pieces(tokenizer_json: str) -> dict[int, bytes]:
    key = derived_cache.entry_key(derived_cache.text_digest(tokenizer_json), __file__)
    return derived_cache.cached("token-bytes", key, lambda: _pieces(tokenizer_json),
                                lambda value: isinstance(value, dict))


class TokenBytes:
    def __init__(self, tokenizer_json: str) -> None:
        self.pieces: dict[int, bytes] = _cached_pieces(tokenizer_json)

    def bytes_of(self, token_ids: Sequence[int]) -> bytes:
        pieces = self.pieces
        return b"".join(pieces.get(t, b"") for t in token_ids)

    def decode(self, token_ids: Sequence[int]) -> str:
        """Whole-sequence decode (invalid UTF-8 replaced)."""
        return self.bytes_of(token_ids).decode("utf-8", errors="replace")

    def text_of(self, token_id: int) -> str:
        return self.pieces.get(token_id, b"").decode("utf-8", errors="replace")


@lru_cache(maxsize=2)
def token_bytes(tokenizer_json: str) -> TokenBytes:
    return TokenBytes(tokenizer_json)


class TextDecoder:
    def __init__(self, table: TokenBytes) -> None:
        self._table = table
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._utf8.decode(self._table.bytes_of(token_ids))

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)
