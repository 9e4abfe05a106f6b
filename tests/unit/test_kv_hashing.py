"""Block hashing: chaining, partial blocks, salt separation, stability (property tests)."""

from __future__ import annotations

import hashlib
import struct
from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer_gateway.kvcache.hashing import block_hashes, kv_salt, pack_tokens

BT = 4  # small blocks keep the examples readable; the code is block-size agnostic
SALT = kv_salt("model", "sm100")
tokens = st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=40)


@given(tokens, tokens)
def test_equal_prefix_iff_equal_hash(a: list[int], b: list[int]) -> None:
    ha, hb = block_hashes(a, SALT, BT), block_hashes(b, SALT, BT)
    for i in range(min(len(ha), len(hb))):
        assert (ha[i] == hb[i]) == (a[: (i + 1) * BT] == b[: (i + 1) * BT])


@given(tokens, st.lists(st.integers(0, 1000), min_size=1, max_size=40))
def test_a_shared_prefix_shares_hashes_then_diverges(prefix: list[int], tail: list[int]) -> None:
    base = prefix + tail
    changed = prefix + [t + 1 for t in tail]
    n_shared = len(prefix) // BT
    ha, hb = block_hashes(base, SALT, BT), block_hashes(changed, SALT, BT)
    assert ha[:n_shared] == hb[:n_shared]
    assert all(x != y for x, y in zip(ha[n_shared:], hb[n_shared:], strict=False))


@given(tokens, st.lists(st.integers(0, 2**32 - 1), max_size=BT - 1))
def test_partial_block_is_ignored(a: list[int], partial: list[int]) -> None:
    full = a[: len(a) // BT * BT]
    assert block_hashes(full + partial, SALT, BT) == block_hashes(full, SALT, BT)
    assert len(block_hashes(a, SALT, BT)) == len(a) // BT


@given(tokens)
def test_salt_separates_formats_and_models(a: list[int]) -> None:
    other_format = block_hashes(a, kv_salt("model", "ascend950"), BT)
    other_model = block_hashes(a, kv_salt("model-b", "sm100"), BT)
    mine = block_hashes(a, SALT, BT)
    assert not set(mine) & set(other_format)
    assert not set(mine) & set(other_model)


@settings(max_examples=50)
@given(tokens)
def test_input_types_agree_and_hashes_are_63_bit(a: list[int]) -> None:
    expected = block_hashes(a, SALT, BT)
    assert block_hashes(tuple(a), SALT, BT) == expected
    assert block_hashes(array("I", a), SALT, BT) == expected
    assert block_hashes(a, SALT, BT, packed=pack_tokens(a)) == expected
    assert all(0 <= h < 2**63 for h in expected)


def test_packed_tokens_must_match_the_ids() -> None:
    with pytest.raises(ValueError, match="packed tokens hold 3 ids, the prompt 4"):
        block_hashes([1, 2, 3, 4], SALT, 2, packed=pack_tokens([1, 2, 3]))


def test_stable_values() -> None:
    """Golden values: changing them invalidates every index and KV store key (bump on purpose only)."""
    got = block_hashes(list(range(256)), kv_salt("DeepSeek-V4.1-Flash", "sm100"))
    assert got == GOLDEN


def test_default_block_size_is_128() -> None:
    assert len(block_hashes(list(range(128 * 3 + 127)), SALT)) == 3
    assert block_hashes(list(range(127)), SALT) == []


def test_out_of_range_tokens_are_rejected() -> None:
    with pytest.raises(OverflowError):
        block_hashes([-1] * BT, SALT, BT)
    with pytest.raises(OverflowError):
        block_hashes([2**32] * BT, SALT, BT)


GOLDEN = [2541247095137000253, 4034258857927449225]


def reference(token_ids: list[int], salt: bytes, block_tokens: int) -> list[int]:
    """The documented encoding, written the slow obvious way."""
    out, prev = [], salt
    for i in range(len(token_ids) // block_tokens):
        block = token_ids[i * block_tokens : (i + 1) * block_tokens]
        prev = hashlib.sha256(prev + struct.pack(f"<{len(block)}I", *block)).digest()
        out.append(int.from_bytes(prev[:8], "little") & (2**63 - 1))
    return out


@given(tokens)
def test_matches_the_documented_encoding(a: list[int]) -> None:
    assert block_hashes(a, SALT, BT) == reference(a, SALT, BT)


# --- PrefixHasher: reuse of recent chains is exact ------------------------------------------

from hypothesis import given as _given  # noqa: E402
from hypothesis import settings as _settings  # noqa: E402
from hypothesis import strategies as _st  # noqa: E402

from deepinfer_gateway.kvcache.hashing import PrefixHasher  # noqa: E402


@_settings(max_examples=60, deadline=None)
@_given(_st.lists(_st.tuples(_st.integers(0, 6), _st.integers(0, 900), _st.integers(0, 3)), min_size=1, max_size=8))
def test_prefix_hasher_equals_block_hashes(turns: list[tuple[int, int, int]]) -> None:
    """Each turn keeps a prefix of the previous prompt (in tokens), changes a token, appends."""
    salts = [kv_salt("m", "sm100"), kv_salt("m", "ascend950")]
    hasher = PrefixHasher(max_bytes=4096 * 3, per_family=2, block_tokens=16)
    prompt: list[int] = [7] * 40
    for keep_blocks, append, edit in turns:
        prompt = prompt[: keep_blocks * 16 + edit] + [(edit * 31 + i) % 50 for i in range(append)]
        packed = pack_tokens(prompt) if edit % 2 else None  # as the encoder hands it over, or not
        assert hasher.hashes(prompt, salts, packed=packed) == [block_hashes(prompt, s, 16) for s in salts]
