"""Prefill/decode KV hand-off through the shared KV store.

The prefill worker stores its prompt's KV blocks under their block hashes (plus the
partial tail block's hash) and answers with a `KvHandoff`; the decode worker checks the
hand-off describes its prompt and loads the blocks back. Both run on the step thread.
"""

from __future__ import annotations

from collections.abc import Callable

from deepinfer_gateway.core.protocol import STORE_TTL_S, ErrorKind, GenerateRequest, KvEventKind, KvHandoff, KvTier
from deepinfer_gateway.kvcache.hashing import block_hashes, kv_salt
from deepinfer_gateway.workers.deepinfer.config import DeepInferConfig
from deepinfer_gateway.workers.deepinfer.events import KvEventLog
from deepinfer_gateway.workers.deepinfer.kvstore import KvStore, tail_hash
from deepinfer_gateway.workers.deepinfer.step_messages import RequestError

HANDLE_PREFIX = "kvstore:"


class HandoffError(Exception):
    """The prompt's KV could not be stored; the prefill request ends with this message."""


class KvHandoffs:
    """Both sides of the hand-off for one worker; `store` None: no store configured."""

    def __init__(self, config: DeepInferConfig, store: KvStore | None, events: KvEventLog,
                 clock: Callable[[], float]) -> None:
        self.store = store
        self._events = events
        self._clock = clock
        self._worker_id = config.worker_id
        self._kv_format = config.resolved_kv_format
        self._salt = kv_salt(config.served_model, config.resolved_kv_format)

    def fetch(self, request: GenerateRequest) -> list[bytes]:
        """Decode side: the prompt's KV blocks from the store (prompt = token_ids minus the
        first generated token), after checking the hand-off describes this prompt."""
        handoff = request.kv_handoff
        assert handoff is not None
        if self.store is None:
            raise RequestError(ErrorKind.KV_TRANSFER, "this worker has no KV store configured")
        if handoff.kv_format != self._kv_format:
            raise RequestError(ErrorKind.KV_TRANSFER, f"KV format {handoff.kv_format!r} is not this worker's")
        prompt = request.token_ids[: handoff.num_tokens]
        full = block_hashes(prompt, self._salt)
        if handoff.num_tokens != len(request.token_ids) - 1 or tuple(full) != handoff.block_hashes:
            raise RequestError(ErrorKind.KV_TRANSFER, "kv_handoff does not describe this prompt")
        if not handoff.handle.startswith(HANDLE_PREFIX):
            raise RequestError(ErrorKind.KV_TRANSFER, f"unknown hand-off handle {handoff.handle!r}")
        keys = list(full)
        tail = handoff.handle[len(HANDLE_PREFIX) :]
        if tail:
            keys.append(int(tail, 16))
        blocks = [self.store.get(k) for k in keys]
        missing = sum(b is None for b in blocks)
        if missing:
            raise RequestError(ErrorKind.KV_TRANSFER, f"{missing} of {len(keys)} KV blocks missing from the store")
        return [b for b in blocks if b is not None]

    def save(self, request: GenerateRequest, blocks: list[bytes]) -> KvHandoff:
        """Prefill side: store the prompt's KV `blocks` (as the engine's `pe_do_save_kvcache`
        gave them) and describe the hand-off; `HandoffError` when they cannot be stored."""
        assert self.store is not None
        tokens = request.token_ids
        full = block_hashes(tokens, self._salt)
        tail = tail_hash(tokens, full)
        keys = full + ([tail] if tail is not None else [])
        if len(blocks) != len(keys):
            raise HandoffError(f"engine gave {len(blocks)} KV blocks for {len(keys)} prompt blocks")
        expires_at = self._clock() + STORE_TTL_S[request.workload_class]
        try:
            for key, data in zip(keys, blocks, strict=True):
                self.store.put(key, data, expires_at)
        except Exception as exc:
            raise HandoffError(f"KV store write failed: {exc!r}") from exc
        if full:
            self._events.append(KvEventKind.STORED, KvTier.STORE, full, expires_at)
        return KvHandoff(
            handle=HANDLE_PREFIX + (f"{tail:016x}" if tail is not None else ""),
            source_worker=self._worker_id,
            kv_format=self._kv_format,
            num_tokens=len(tokens),
            block_hashes=tuple(full),
        )
