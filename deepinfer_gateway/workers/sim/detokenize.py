"""A minimal decoder for a byte-level BPE `tokenizer.json` (deepseek-recipe's Tokenizer
only encodes). The sim uses it to read the tail of a prompt, as a model would.

Vocabulary entries spell bytes with GPT-2's printable byte alphabet; added tokens
(special tokens such as `<think>`) are literal text.
"""

from __future__ import annotations

import json
from collections.abc import Sequence


def _byte_alphabet() -> dict[str, int]:
    """GPT-2 `bytes_to_unicode`, inverted: printable char -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


class Detokenizer:
    def __init__(self, tokenizer_json: str) -> None:
        data = json.loads(tokenizer_json)
        alphabet = _byte_alphabet()
        self._pieces: dict[int, bytes] = {
            i: bytes(alphabet.get(ch, 0x3F) for ch in piece) for piece, i in data["model"]["vocab"].items()
        }
        for token in data["added_tokens"]:
            self._pieces[int(token["id"])] = token["content"].encode()

    def decode(self, token_ids: Sequence[int]) -> str:
        return b"".join(self._pieces.get(t, b"") for t in token_ids).decode("utf-8", errors="replace")
