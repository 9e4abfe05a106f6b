"""Synthetic token ids for trace requests: the simulator's stand-in for prompt synthesis.

The live bench (`workload/synthesis.py`) turns each trace block id into 512 tokens of text
and sends it as one user message; the chat template wraps it in a fixed 28-token header
and a 2-token trailer. Block hashes only see token ids, so the simulator needs no text
and no tokenizer, only the same layout:

    [HEADER_TOKENS fixed ids] [block 0: 512 ids] ... [last block: a prefix] [TRAILER_TOKENS ids]

- Block ids of hash id h are a pure function of h: the first three ids spell h in base
  VOCAB, the rest is one fixed sequence shared by every block (chained hashing covers
  the whole block, so the first three ids are enough to tell blocks apart). Equal hash
  ids give equal token blocks at the same positions, distinct ids distinct blocks; a
  partial last block is the prefix of the full one (as in the live synthesis).
- Requests without hash ids (Azure traces) get private blocks, never shared.
- The header offset matters: with it, trace block i covers prompt positions
  [28 + 512 i, 28 + 512 (i + 1)), so 128-token gateway blocks straddle trace blocks
  exactly as on the wire, and cached-token counts round the same way.

Output ids are arbitrary (the sim engine never reads them) but distinct per request.
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import overload

from deepinfer_gateway.kvcache.hashing import pack_tokens
from deepinfer_gateway.workload.types import TraceRequest

VOCAB = 100_000  # stays below every real vocabulary size; ids are < 2**32 as block hashing needs
HEADER_TOKENS = 28  # DeepSeek-V4.1 template: BOS, <｜System｜>, reasoning-effort line, <｜User｜>
TRAILER_TOKENS = 2  # <｜Assistant｜> and the thinking marker
_HEADER = [VOCAB + i for i in range(HEADER_TOKENS)]
_TRAILER = [VOCAB + HEADER_TOKENS + i for i in range(TRAILER_TOKENS)]
_OUTPUT_BASE = VOCAB + 64
_UNIQUE_STRIDE = 1 << 20  # private blocks per request (no prefix info)
_PACKED_DIGITS = struct.Struct("<3I")


class PromptTokens:
    """Token ids per trace request (see the module docstring); caches recent full blocks."""

    def __init__(self, block_size: int = 512, header: bool = True, cache_blocks: int = 262_144) -> None:
        self.block_size = block_size
        self.header = list(_HEADER) if header else []
        self.trailer = list(_TRAILER) if header else []
        self._blocks: OrderedDict[int, list[int]] = OrderedDict()
        self._cache_blocks = cache_blocks
        self._tail = [(13 + 7_919 * j) % VOCAB for j in range(block_size - 3)]
        self._packed_tail = pack_tokens(self._tail)
        self._packed_header = pack_tokens(self.header)
        self._packed_trailer = pack_tokens(self.trailer)

    def _block(self, number: int) -> list[int]:
        """The full block of `number`: three ids spelling it, then the shared tail."""
        ids = self._blocks.get(number)
        if ids is None:
            digits, n = [], number
            for _ in range(3):
                n, d = divmod(n, VOCAB)
                digits.append(d)
            ids = self._blocks[number] = digits + self._tail
            if len(self._blocks) > self._cache_blocks:
                self._blocks.popitem(last=False)
        return ids

    def blocks(self, numbers: Sequence[int], tokens: int) -> list[int]:
        """The first `tokens` ids of the blocks `numbers` laid end to end."""
        out: list[int] = []
        for number in numbers:
            out += self._block(number)
        return out[:tokens]

    def _numbers(self, request: TraceRequest) -> list[int]:
        n_blocks = -(-request.input_length // self.block_size)
        ids = list(request.hash_ids or ())[:n_blocks]
        numbers = [2 * int(h) for h in ids]
        numbers += [2 * (request.index * _UNIQUE_STRIDE + b) + 1 for b in range(len(ids), n_blocks)]
        return numbers

    def prompt(self, request: TraceRequest) -> list[int]:
        size = self.block_size
        numbers = self._numbers(request)
        n_blocks = len(numbers)
        out = list(self.header)
        for i, number in enumerate(numbers):
            block = self._block(number)
            out += block if i < n_blocks - 1 else block[: request.input_length - size * (n_blocks - 1)]
        out += self.trailer
        return out

    def ids(self, request: TraceRequest) -> PromptIds:
        """`self.prompt(request)`, built only where read (see `PromptIds`)."""
        return PromptIds(self, request, [])

    def ids_between(self, request: TraceRequest, start: int, stop: int) -> list[int]:
        """`self.prompt(request)[start:stop]` for 0 <= start <= stop <= its length, from the
        blocks that overlap that range only."""
        size, header = self.block_size, self.header
        out = header[start:stop]
        numbers = self._numbers(request)
        end = len(header) + request.input_length  # the trailer starts here
        first = max(0, (start - len(header)) // size)
        for i in range(first, len(numbers)):
            at = len(header) + i * size
            if at >= stop:
                break
            block = self._block(numbers[i])
            out += block[max(0, start - at) : min(stop, end) - at]
        out += self.trailer[max(0, start - end) : max(0, stop - end)]
        return out

    def packed(self, request: TraceRequest) -> bytes:
        """`pack_tokens(self.prompt(request))` (what block hashing reads), joined from packed
        pieces: a block is its three spelled ids then the shared tail."""
        numbers = self._numbers(request)
        parts = [self._packed_header]
        for number in numbers[:-1]:
            parts += (self._packed_digits(number), self._packed_tail)
        if numbers:
            last = self._packed_digits(numbers[-1]) + self._packed_tail
            parts.append(last[: 4 * (request.input_length - self.block_size * (len(numbers) - 1))])
        parts.append(self._packed_trailer)
        return b"".join(parts)

    @staticmethod
    def _packed_digits(number: int) -> bytes:
        """`pack_tokens` of the three ids spelling `number` (little-endian uint32 words)."""
        high, low = divmod(number, VOCAB)
        return _PACKED_DIGITS.pack(low, high % VOCAB, high // VOCAB % VOCAB)

    @staticmethod
    def output(request: TraceRequest) -> list[int]:
        """`output_length` ids (at least one: every request yields a first token)."""
        start = _OUTPUT_BASE + (request.index % 4_096) * 4_096
        return list(range(start, start + max(1, request.output_length)))


class PromptIds(Sequence[int]):
    """A prompt's token ids (`PromptTokens.prompt`) followed by `extra` ids, built only where
    read. The simulator reads a prompt's length for routing and admission, and its ids only
    past its last full block (to extend the block hashes at a hand-off or a finish): the
    whole list, ~13k ids per Mooncake request, would be built and copied for nothing."""

    __slots__ = ("_prompts", "_request", "_extra", "_prompt_len")

    def __init__(self, prompts: PromptTokens, request: TraceRequest, extra: list[int]) -> None:
        self._prompts, self._request, self._extra = prompts, request, extra
        self._prompt_len = len(prompts.header) + request.input_length + len(prompts.trailer)

    def __len__(self) -> int:
        return self._prompt_len + len(self._extra)

    @overload
    def __getitem__(self, i: int) -> int: ...

    @overload
    def __getitem__(self, i: slice) -> list[int]: ...

    def __getitem__(self, i: int | slice) -> int | list[int]:
        if isinstance(i, slice):
            start, stop, stride = i.indices(len(self))
            if stride != 1:
                return self[:][start:stop:stride]
            return self._between(start, max(start, stop))
        n = len(self)
        if not -n <= i < n:
            raise IndexError("prompt index out of range")
        i %= n
        return self._between(i, i + 1)[0]

    def _between(self, start: int, stop: int) -> list[int]:
        split = self._prompt_len
        out = self._prompts.ids_between(self._request, start, min(stop, split)) if start < split else []
        out += self._extra[max(0, start - split) : max(0, stop - split)]
        return out

    def __iter__(self) -> Iterator[int]:
        return iter(self[:])

    def __add__(self, other: Sequence[int]) -> PromptIds:
        return PromptIds(self._prompts, self._request, self._extra + list(other))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PromptIds | list):
            return self[:] == list(other)
        return NotImplemented
