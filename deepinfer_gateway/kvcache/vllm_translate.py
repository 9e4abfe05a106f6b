"""vLLM's KV event batches: their wire format, and their translation into the index's own
`KvEventBatch`es (pure: no I/O; `vllm_events.VllmKvSubscriber` does the receiving).

Decoding mirrors `vllm.distributed.kv_events` (msgspec, as vLLM encodes): the batch is an
array `[ts, events, data_parallel_rank?]`, each event a map tagged by `type`; unknown fields
are ignored. Block hashes are ints (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`, vLLM's default)
or bytes.

Hash mapping: vLLM's block hashes are not the index's keys (another function, and a
per-process random seed for non-cryptographic algorithms unless PYTHONHASHSEED is set).
`BlockStored` carries the blocks' token ids and its parent's vLLM hash, so the translator
recomputes the gateway's chained hash (`hashing.chain_digest`, salted by model and KV format)
from the parent's digest and keeps `vLLM hash -> our digest` per worker: the parent lookup of
the next `BlockStored` and `BlockRemoved` go through it. A block whose parent it does not know
(stored before we listened, and gone from the replay buffer) is skipped: under-prediction,
never a false hit.

Epochs: our events get gap-free seqs within an epoch the translator owns; `new_epoch` opens a
fresh one whose first event is `cleared` (the worker's memory tier dropped in the index).
"""

from __future__ import annotations

import uuid
from typing import Any

import msgspec

from deepinfer_gateway.core.protocol import KV_BLOCK_TOKENS, KvEvent, KvEventBatch, KvEventKind, KvTier
from deepinfer_gateway.kvcache.hashing import chain_digest, digest_hash

VllmHash = int | bytes
_INDEXED_MEDIA = (None, "GPU")  # the engine's own KV memory (vLLM says "GPU" on CPU builds too)


class BlockStored(msgspec.Struct, tag=True):
    block_hashes: list[VllmHash]
    parent_block_hash: VllmHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None


class BlockRemoved(msgspec.Struct, tag=True):
    block_hashes: list[VllmHash]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, tag=True):
    pass


class VllmEventBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


_decoder = msgspec.msgpack.Decoder(VllmEventBatch)


def decode_batch(payload: bytes) -> VllmEventBatch:
    return _decoder.decode(payload)


class VllmKvTranslator:
    """vLLM event batches -> `KvEventBatch`es for one worker (pure: no I/O)."""

    def __init__(self, worker_id: str, salt: bytes, block_tokens: int = KV_BLOCK_TOKENS) -> None:
        self.worker_id = worker_id
        self.salt = salt
        self.block_tokens = block_tokens
        self.epoch = ""
        self._seq = 0
        self._digests: dict[VllmHash, bytes] = {}
        self._pending: list[KvEvent] = []
        self.skipped_blocks = 0  # blocks not indexed: unknown parent, LoRA, extra keys, other media
        self.new_epoch()

    @property
    def known_blocks(self) -> int:
        return len(self._digests)

    def new_epoch(self) -> None:
        """Forget every block: the next batch starts a new epoch with a `cleared` event."""
        self.epoch = uuid.uuid4().hex[:16]
        self._seq = 0
        self._digests.clear()
        self._pending = [self._event(KvEventKind.CLEARED, [])]

    def translate(self, batch: VllmEventBatch) -> KvEventBatch | None:
        """The index batch for one vLLM batch (None when nothing changed for the index)."""
        events, self._pending = self._pending, []
        for event in batch.events:
            if isinstance(event, BlockStored):
                hashes = self._stored(event)
                if hashes:
                    events.append(self._event(KvEventKind.STORED, hashes))
            elif isinstance(event, BlockRemoved):
                hashes = self._removed(event)
                if hashes:
                    events.append(self._event(KvEventKind.EVICTED, hashes))
            else:
                self._digests.clear()
                events.append(self._event(KvEventKind.CLEARED, []))
        return self.flush(events)

    def flush(self, events: list[KvEvent] | None = None) -> KvEventBatch | None:
        """A batch of `events` (default: the pending `cleared` of a new epoch), or None."""
        if events is None:
            events, self._pending = self._pending, []
        if not events:
            return None
        return KvEventBatch(
            worker_id=self.worker_id, epoch=self.epoch, events=events,
            last_seq=events[-1].seq, oldest_seq=events[0].seq,
        )

    def _event(self, kind: KvEventKind, hashes: list[int]) -> KvEvent:
        self._seq += 1
        return KvEvent(seq=self._seq, kind=kind, tier=KvTier.MEMORY, block_hashes=hashes)

    def _stored(self, event: BlockStored) -> list[int]:
        n = len(event.block_hashes)
        if (
            event.medium not in _INDEXED_MEDIA
            or event.group_idx not in (None, 0)
            or event.lora_id is not None
            or event.lora_name is not None
            or (event.extra_keys and any(k for k in event.extra_keys))  # cache_salt, multimodal: not token-only
            or event.block_size != self.block_tokens
        ):
            self.skipped_blocks += n
            return []
        prev = self.salt if event.parent_block_hash is None else self._digests.get(event.parent_block_hash)
        if prev is None:
            self.skipped_blocks += n
            return []
        out: list[int] = []
        tokens, size = event.token_ids, event.block_size
        for i, vllm_hash in enumerate(event.block_hashes):
            block = tokens[i * size : (i + 1) * size]
            if len(block) < size:
                self.skipped_blocks += n - i
                break
            prev = chain_digest(prev, block)
            self._digests[vllm_hash] = prev
            out.append(digest_hash(prev))
        return out

    def _removed(self, event: BlockRemoved) -> list[int]:
        if event.medium not in _INDEXED_MEDIA or event.group_idx not in (None, 0):
            return []
        out = []
        for vllm_hash in event.block_hashes:
            digest = self._digests.pop(vllm_hash, None)
            if digest is not None:
                out.append(digest_hash(digest))
        return out
