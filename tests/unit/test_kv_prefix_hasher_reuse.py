"""`PrefixHasher` finds the longest remembered prefix among many prompts of one family
(conversations behind one system prompt), digests only the rest, and stays in bounds."""

from __future__ import annotations

import pytest

from deepinfer_gateway.kvcache import hashing
from deepinfer_gateway.kvcache.hashing import _BLOCK_SALT_BYTES, BlockHashes, PrefixHasher, block_hashes, kv_salt

BT = 16
SALTS = [kv_salt("m", "sm100"), kv_salt("m", "ascend950")]
SYSTEM = [7] * (2 * BT)  # every prompt starts with the same two blocks: one family


def conversation(n: int, blocks: int) -> list[int]:
    return SYSTEM + [1000 + n] * (blocks * BT)


@pytest.fixture
def digested(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    count = [0]
    chain = hashing._chain

    def counting(data: memoryview, step: int, start_block: int, prev: bytes, digests: list[bytes]) -> None:
        count[0] += len(range(start_block * step, len(data), step))
        chain(data, step, start_block, prev, digests)

    monkeypatch.setattr(hashing, "_chain", counting)
    return count


def test_a_follow_up_of_an_old_conversation_digests_only_its_new_blocks(digested: list[int]) -> None:
    hasher = PrefixHasher(per_family=64, block_tokens=BT)
    for n in range(20):  # the first conversation's turn is now the family's oldest
        hasher.hashes(conversation(n, 3), SALTS)
    follow_up = conversation(0, 3) + [5] * (2 * BT)
    expected = [block_hashes(follow_up, s, BT) for s in SALTS]
    digested[0] = 0
    assert hasher.hashes(follow_up, SALTS) == expected
    assert digested[0] == 2 * len(SALTS)  # its two new blocks, per salt
    other = conversation(9, 2) + [6] * BT  # shares 4 of conversation 9's 5 blocks
    expected = [block_hashes(other, s, BT) for s in SALTS]
    digested[0] = 0
    assert hasher.hashes(other, SALTS) == expected
    assert digested[0] == 1 * len(SALTS)


def test_per_family_and_max_bytes_bound_what_is_kept() -> None:
    prompt_bytes = 5 * BT * 4 + 5 * len(SALTS) * _BLOCK_SALT_BYTES  # 5 blocks: tokens, digests, hashes
    hasher = PrefixHasher(per_family=4, block_tokens=BT)
    for n in range(10):
        hasher.hashes(conversation(n, 3), SALTS)
    (family,) = hasher._families.values()
    assert len(family.chains) == 4 and hasher._bytes == 4 * prompt_bytes
    small = PrefixHasher(max_bytes=3 * prompt_bytes, block_tokens=BT)  # three prompts' worth, one family
    for n in range(10):
        small.hashes(conversation(n, 3), SALTS)
    (family,) = small._families.values()
    assert len(family.chains) == 3 and small._bytes == 3 * prompt_bytes
    assert family.ordered == sorted(family.chains)


def test_a_caller_changing_its_hashes_does_not_change_later_ones() -> None:
    hasher = PrefixHasher(block_tokens=BT)
    first = hasher.hashes(conversation(1, 3), SALTS)
    for hashes in first:
        hashes[:] = [0] * len(hashes)  # the caller owns what it got
    follow_up = conversation(1, 3) + [5] * BT
    again = hasher.hashes(follow_up, SALTS)
    assert again == [block_hashes(follow_up, s, BT) for s in SALTS]
    tails = [h.chain_tail for h in again if isinstance(h, BlockHashes)]
    assert tails == [h.chain_tail for s in SALTS if isinstance(h := block_hashes(follow_up, s, BT), BlockHashes)]
    assert len(tails) == len(SALTS)
