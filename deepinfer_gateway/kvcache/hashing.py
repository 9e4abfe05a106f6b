"""Chained block hashing: the one function gateway, sim and DeepInfer workers share.

A prompt is cut into 128-token blocks; block i's hash covers the salt and every token of
blocks 0..i (chained: h_i = H(h_{i-1} || tokens_i)), so equal hashes mean equal
prefixes. The final partial block is not hashed (engines cache only full blocks).
The salt separates models and KV formats: SM100 and Ascend KV may be incompatible,
so the same tokens on different formats must never look like a shared prefix.

Hashes are unsigned 63-bit ints (fit in a signed int64, Redis- and JSON-safe).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

from deepinfer_gateway.protocol import KV_BLOCK_TOKENS

_MASK63 = (1 << 63) - 1


def kv_salt(model: str, kv_format: str) -> bytes:
    return hashlib.blake2b(f"{model}\x00{kv_format}".encode(), digest_size=8).digest()


def block_hashes(token_ids: Sequence[int], salt: bytes, block_tokens: int = KV_BLOCK_TOKENS) -> list[int]:
    n_full = len(token_ids) // block_tokens
    if n_full == 0:
        return []
    data = array("I", token_ids[: n_full * block_tokens]).tobytes()
    step = block_tokens * 4
    out: list[int] = []
    prev = salt
    blake = hashlib.blake2b
    for i in range(n_full):
        digest = blake(prev + data[i * step : (i + 1) * step], digest_size=8).digest()
        out.append(int.from_bytes(digest, "little") & _MASK63)
        prev = digest
    return out
