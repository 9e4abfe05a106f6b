"""Chained block hashing: the one function gateway, sim and DeepInfer workers share.

A prompt is cut into 128-token blocks; block i's hash covers the salt and every token of
blocks 0..i (chained: d_i = SHA-256(d_{i-1} || tokens_i), d_-1 = salt), so equal hashes
mean equal prefixes. The final partial block is not hashed (engines cache only full
blocks). The salt separates models and KV formats: SM100 and Ascend KV may be
incompatible, so the same tokens on different formats must never look like a shared
prefix; a request's cache salt (`kv_salt`'s `cache_salt`) separates tenants the same way.

Encoding (stable; changing it invalidates every index and KV store key): tokens are
little-endian uint32, the chain carries the full 32-byte digest, and the published hash
is the low 63 bits of the digest's first 8 bytes read little-endian (fits a signed
int64: Redis- and JSON-safe).

Why SHA-256: it is collision resistant (a client must not be able to forge another
tenant's prefix hash, cf. vLLM's move away from Python's hash()), and OpenSSL runs it
on the CPU's SHA extensions. Cost for 131,072 tokens (1,024 blocks) on the 2-core dev
boxes: packing a list into uint32s costs 0.7-1.4 ms (`array.fromlist`, the fastest
list->bytes path in CPython) and the 1,024 chained digests 0.9-1.5 ms. The gateway skips
the first part: its prompt encoder hands over the prompt already packed (`pack_tokens`
is applied once per cached text segment, recipe_bridge/encoder.py), so a request pays
only the digests, and a follow-up turn only the digests of its new blocks
(`PrefixHasher`). Hashing is per kv_format: a router comparing SM100 and Ascend workers
digests the prompt once per format.

The published hashes are truncated, so a chain cannot be continued from them: the
hashes returned here are `BlockHashes` (typed as plain lists, which they are to every
reader), lists that also keep their salt and last full digest, and
`extend_block_hashes` continues one over later tokens (a worker caching
prompt + output at finish digests only the blocks past the prompt).
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from bisect import bisect_left, insort
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from deepinfer_gateway.core.protocol import KV_BLOCK_TOKENS

_MASK63 = (1 << 63) - 1
_BIG_ENDIAN = sys.byteorder == "big"
_SHA256_EMPTY = hashlib.sha256()  # copied per block: cheaper than a constructor lookup

assert array("I").itemsize == 4 and array("Q").itemsize == 8


class BlockHashes(list[int]):
    """Published block hashes (a plain list of ints to every reader) that remember where
    their chain ends: `salt`, and `chain_tail`, the digest the next block chains from
    (the last block's, or the salt when there are no blocks)."""

    __slots__ = ("salt", "chain_tail")
    salt: bytes
    chain_tail: bytes


def kv_salt(model: str, kv_format: str, cache_salt: str | None = None) -> bytes:
    """The chain's seed for a model and KV format; `cache_salt` (a request's, as vLLM's field)
    gives a chain no request without that exact salt shares, so neither its blocks nor their
    hashes in the index are reachable from another tenant's prompt."""
    if cache_salt is None:
        return hashlib.blake2b(f"{model}\x00{kv_format}".encode(), digest_size=8).digest()
    # Length-prefixed, so no (model, format, salt) spells another's, nor the unsalted seed.
    seed = f"{len(model)}:{model}\x00{len(kv_format)}:{kv_format}\x00{cache_salt}"
    return hashlib.blake2b(seed.encode(), digest_size=32, person=b"dgw-cache-salt").digest()  # no collisions to forge


def block_hashes(
    token_ids: Sequence[int], salt: bytes, block_tokens: int = KV_BLOCK_TOKENS, *, packed: bytes | None = None
) -> list[int]:
    """Chained hashes of every full `block_tokens` block of `token_ids` (a `BlockHashes`).

    Token ids must be in [0, 2**32) (OverflowError otherwise). `packed`, when given, is
    `pack_tokens(token_ids)` (the caller vouches for it) and saves packing them again.
    """
    n_full = len(token_ids) // block_tokens
    digests: list[bytes] = []
    if n_full:
        _chain(_packed_view(token_ids, n_full * block_tokens, packed), block_tokens * 4, 0, salt, digests)
    return _published(digests, salt, salt)


def extend_block_hashes(
    known: BlockHashes, token_ids: Sequence[int], block_tokens: int = KV_BLOCK_TOKENS
) -> BlockHashes:
    """`block_hashes(prefix + token_ids, known.salt)`, where `known` are the hashes of
    `prefix`'s full blocks and `token_ids` the tokens after them (from token
    `len(known) * block_tokens` on): only the new blocks are digested."""
    n_full = len(token_ids) // block_tokens
    digests: list[bytes] = []
    if n_full:
        _chain(_pack(token_ids, n_full * block_tokens), block_tokens * 4, 0, known.chain_tail, digests)
    extended = _published(digests, known.salt, known.chain_tail)
    extended[:0] = known
    return extended


def chain_digest(prev: bytes, block_token_ids: Sequence[int]) -> bytes:
    """The chain digest of one block: `prev` is the salt for block 0, else the previous
    block's digest. For consumers that learn a prefix block by block (an engine's KV
    events); `digest_hash` turns it into the published hash."""
    h = _SHA256_EMPTY.copy()
    h.update(prev)
    h.update(_pack(block_token_ids, len(block_token_ids)))
    return h.digest()


def digest_hash(digest: bytes) -> int:
    """The published hash of a chain digest (as `block_hashes` returns it)."""
    return int.from_bytes(digest[:8], "little") & _MASK63


def pack_tokens(token_ids: Sequence[int]) -> bytes:
    """Token ids as the hash reads them: little-endian uint32 words."""
    return _pack(token_ids, len(token_ids)).tobytes()


def _packed_view(token_ids: Sequence[int], n_tokens: int, packed: bytes | None) -> memoryview:
    if packed is None:
        return _pack(token_ids, n_tokens)
    if len(packed) != 4 * len(token_ids):
        raise ValueError(f"packed tokens hold {len(packed) // 4} ids, the prompt {len(token_ids)}")
    return memoryview(packed)[: 4 * n_tokens]


def _pack(token_ids: Sequence[int], n_tokens: int) -> memoryview:
    words = array("I")
    if isinstance(token_ids, list):
        words.fromlist(token_ids[:n_tokens] if len(token_ids) != n_tokens else token_ids)
    else:
        words.extend(token_ids[:n_tokens])
    if _BIG_ENDIAN:
        words.byteswap()
    return memoryview(words).cast("B")


def _chain(data: memoryview, step: int, start_block: int, prev: bytes, digests: list[bytes]) -> None:
    copy = _SHA256_EMPTY.copy
    append = digests.append
    for start in range(start_block * step, len(data), step):
        h = copy()
        h.update(prev)
        h.update(data[start : start + step])
        prev = h.digest()
        append(prev)


def _published(digests: list[bytes], salt: bytes, prev: bytes) -> BlockHashes:
    """The hashes of `digests`, a chain that continues from `prev`."""
    words64 = array("Q", b"".join(digests))
    if _BIG_ENDIAN:
        words64.byteswap()
    hashes = BlockHashes([w & _MASK63 for w in words64[::4]])
    hashes.salt = salt
    hashes.chain_tail = digests[-1] if digests else prev
    return hashes


class PrefixHasher:
    """`block_hashes` for several salts at once (the tokens are packed once), reusing the
    chain of the recent prompt that shares the longest prefix with this one.

    Agents and chats re-send the same history every turn: a follow-up shares all but its
    last blocks with an earlier turn, so only the new blocks are digested. Recent prompts
    are kept per first block (a family: many conversations share one system prompt), the
    `per_family` most recently used of each, sorted by their bytes: the one sharing the
    longest prefix is a neighbour of the new prompt in that order (bisect, memcmp), and
    the shared length is found by binary search over block boundaries with memcmp,
    ~0.1 ms for 128k tokens. Exact: reused digests cover byte-identical token prefixes.
    Bounded: at most ~`max_bytes` of memory for the remembered prompts, their digests and
    hashes (least recently used families first, then a lone family's least recently used
    prompts).
    """

    def __init__(self, max_bytes: int = 64 << 20, per_family: int = 1024, block_tokens: int = KV_BLOCK_TOKENS):
        self.max_bytes = max_bytes
        self.per_family = per_family
        self.block_tokens = block_tokens
        self._families: OrderedDict[bytes, _Family] = OrderedDict()
        self._bytes = 0

    def hashes(
        self, token_ids: Sequence[int], salts: Sequence[bytes], *, packed: bytes | None = None
    ) -> list[list[int]]:
        """Per salt, `block_hashes(token_ids, salt)` (a `BlockHashes`); `packed` as in `block_hashes`."""
        step = self.block_tokens * 4
        n_full = len(token_ids) // self.block_tokens
        if n_full == 0:
            return [_published([], salt, salt) for salt in salts]
        data = _packed_view(token_ids, n_full * self.block_tokens, packed)
        full = data.tobytes()  # bytes: slice comparison is a memcmp (memoryview's is per item)
        family_key = full[:step]
        family = self._families.pop(family_key, None) or _Family()
        self._families[family_key] = family  # most recently used
        known, shared = family.longest(full, step)
        chain = _Chain(full, {}, {})
        out: list[list[int]] = []
        for salt in salts:
            reused = known is not None and salt in known.digests
            digests = list(known.digests[salt][:shared]) if known is not None and reused else []
            start = len(digests)
            prev = digests[-1] if digests else salt
            _chain(data, step, start, prev, digests)
            chain.digests[salt] = digests
            # The reused blocks' hashes are the known chain's int objects: dict lookups of them
            # (prefix index, caches) match by identity, without comparing values.
            hashes = _published(digests[start:], salt, prev)
            if known is not None and start:
                hashes[:0] = known.hashes[salt][:start]
            chain.hashes[salt] = tuple(hashes)
            out.append(hashes)
        if known is not None and shared * step == len(known.data):  # it extends that prompt: keep the longer
            self._bytes -= family.remove(known)
        self._bytes += family.add(chain)
        while len(family.chains) > self.per_family:
            self._bytes -= family.remove(next(iter(family.chains.values())))
        self._evict()
        return out

    def _evict(self) -> None:
        families = self._families
        while self._bytes > self.max_bytes:
            if len(families) > 1:
                _, evicted = families.popitem(last=False)
                self._bytes -= sum(_size(chain) for chain in evicted.chains.values())
                continue
            (only,) = families.values()
            if len(only.chains) <= 1:
                return  # the prompt just hashed stays
            self._bytes -= only.remove(next(iter(only.chains.values())))


# Memory of one block per salt beyond its packed tokens: its digest (a 32-byte bytes object:
# 65 bytes), its published hash (an int: 36) and their two list slots (16). An upper bound:
# a follow-up's chain shares the digest and hash objects of the prompt it extends.
_BLOCK_SALT_BYTES = 117


def _size(chain: _Chain) -> int:
    return len(chain.data) + _BLOCK_SALT_BYTES * sum(len(digests) for digests in chain.digests.values())


@dataclass(slots=True)
class _Chain:
    data: bytes  # packed full-block tokens
    digests: dict[bytes, list[bytes]]  # salt -> chained digests, one per block
    hashes: dict[bytes, tuple[int, ...]]  # salt -> published hashes, one per block


class _Family:
    """The remembered prompts that start with one block: by recency and by their bytes."""

    __slots__ = ("chains", "ordered")

    def __init__(self) -> None:
        self.chains: dict[bytes, _Chain] = {}  # data -> chain, least recently used first
        self.ordered: list[bytes] = []  # the same data, sorted

    def longest(self, data: bytes, step: int) -> tuple[_Chain | None, int]:
        """The chain sharing the most leading blocks with `data` (block 0 is shared), and how many.
        In sorted order, the longest common prefix is with a neighbour of where `data` goes."""
        ordered = self.ordered
        at = bisect_left(ordered, data)
        best, best_blocks = None, 0
        for old in ordered[max(0, at - 1) : at + 1]:
            if data.startswith(old):  # the usual follow-up: it extends that prompt
                shared = len(old) // step
            else:  # largest k with equal first k blocks; startswith on a memoryview slice = memcmp, no copy
                view = memoryview(old)
                lo, hi = 1, min(len(old), len(data)) // step
                while lo < hi:
                    mid = (lo + hi + 1) // 2
                    if data.startswith(view[: mid * step]):
                        lo = mid
                    else:
                        hi = mid - 1
                shared = lo
            # On a tie, a prompt the new one extends (it is then dropped).
            if shared > best_blocks or (shared == best_blocks and shared * step == len(old)):
                best, best_blocks = self.chains[old], shared
        if best is not None:
            self.chains[best.data] = self.chains.pop(best.data)  # most recently used
        return best, best_blocks

    def add(self, chain: _Chain) -> int:
        """Remember `chain` (replacing one with the same prompt); the bytes added."""
        old = self.chains.pop(chain.data, None)
        self.chains[chain.data] = chain
        if old is not None:
            return _size(chain) - _size(old)
        insort(self.ordered, chain.data)
        return _size(chain)

    def remove(self, chain: _Chain) -> int:
        """Forget `chain`; the bytes freed."""
        del self.chains[chain.data]
        ordered = self.ordered
        del ordered[bisect_left(ordered, chain.data)]
        return _size(chain)
