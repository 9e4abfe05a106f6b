"""The KV store tier seam: block bytes by block hash, with a TTL per workload class.

A prefill worker writes every full 128-token prompt block under its chained block hash
(`kvcache.hashing.block_hashes` with `kv_salt(model, kv_format)`, the same hashes the
gateway's prefix index uses) plus the trailing partial block under `tail_hash`, and hands
the decode worker a `KvHandoff` naming them. Production would put 3FS (or any shared
object store) behind this interface; `MemoryKvStore` serves tests and single-process
demos, `FileKvStore` a shared directory (NFS/3FS mount) between processes.

Expiry is lazy: a `get` past `expires_at` is a miss. Nothing here sweeps.
"""

from __future__ import annotations

import hashlib
import os
import struct
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

from deepinfer_gateway.core.protocol import KV_BLOCK_TOKENS

_MASK63 = (1 << 63) - 1


class KvStore(Protocol):
    """Thread-safe: called from the engine's step thread."""

    def put(self, block_hash: int, data: bytes, expires_at: float) -> None: ...

    def get(self, block_hash: int) -> bytes | None:
        """The block's bytes, or None when absent or expired."""


def tail_hash(
    token_ids: Sequence[int], full_block_hashes: Sequence[int], block_tokens: int = KV_BLOCK_TOKENS
) -> int | None:
    """Key of the trailing partial block (chained on the last full block's hash), None when
    the prompt ends on a block boundary. Partial blocks are never in the prefix index, so
    this key only ever travels inside a `KvHandoff.handle`."""
    n_full = len(token_ids) // block_tokens
    tail = token_ids[n_full * block_tokens :]
    if not tail:
        return None
    prev = full_block_hashes[n_full - 1] if n_full else 0
    data = b"tail" + prev.to_bytes(8, "little") + struct.pack(f"<{len(tail)}I", *tail)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") & _MASK63


class MemoryKvStore:
    """In-process store (tests, one-process demos). `clock` is injectable for TTL tests."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._blocks: dict[int, tuple[bytes, float]] = {}
        self._lock = threading.Lock()
        self._clock = clock

    def put(self, block_hash: int, data: bytes, expires_at: float) -> None:
        with self._lock:
            self._blocks[block_hash] = (bytes(data), expires_at)

    def get(self, block_hash: int) -> bytes | None:
        with self._lock:
            entry = self._blocks.get(block_hash)
        if entry is None or entry[1] <= self._clock():
            return None
        return entry[0]

    def __len__(self) -> int:
        return len(self._blocks)


class FileKvStore:
    """One file per block in a directory shared by prefill and decode workers.

    Writes go to a temporary name and are renamed into place, so a reader never sees a
    partial block; the expiry is the file's mtime (set with os.utime), so an external
    sweeper can delete expired blocks with `find -newermt`-style tools.
    """

    def __init__(self, root: str | os.PathLike[str], clock: Callable[[], float] = time.time) -> None:
        self._root = Path(root)
        self._root.mkdir(parents=True, exist_ok=True)
        self._clock = clock

    def _path(self, block_hash: int) -> Path:
        name = f"{block_hash:016x}"
        return self._root / name[:2] / name

    def put(self, block_hash: int, data: bytes, expires_at: float) -> None:
        path = self._path(block_hash)
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_bytes(data)
        os.utime(tmp, (expires_at, expires_at))
        os.replace(tmp, path)

    def get(self, block_hash: int) -> bytes | None:
        path = self._path(block_hash)
        try:
            if path.stat().st_mtime <= self._clock():
                return None
            return path.read_bytes()
        except FileNotFoundError:
            return None
