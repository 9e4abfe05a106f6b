"""The KV store seam (memory and file directory), tail keys and finish-reason mapping."""

from __future__ import annotations

from pathlib import Path

import pytest

from deepinfer_gateway.core.protocol import ErrorKind, FinishReason, Sampling, StructuredOutput
from deepinfer_gateway.kvcache.hashing import block_hashes, kv_salt
from deepinfer_gateway.workers.deepinfer import FileKvStore, KvStore, MemoryKvStore
from deepinfer_gateway.workers.deepinfer.kvstore import tail_hash
from deepinfer_gateway.workers.deepinfer.mapping import map_finish, sampling_kwargs


@pytest.mark.parametrize("kind", ["memory", "file"])
def test_store_put_get_and_lazy_expiry(kind: str, tmp_path: Path) -> None:
    now = [1000.0]
    store: KvStore = MemoryKvStore(lambda: now[0]) if kind == "memory" else FileKvStore(tmp_path, lambda: now[0])
    store.put(7, b"abc", expires_at=1010.0)
    store.put(2**62, b"x" * 4096, expires_at=2000.0)
    assert store.get(7) == b"abc" and store.get(2**62) == b"x" * 4096 and store.get(8) is None
    store.put(7, b"new", expires_at=1010.0)  # overwrite is atomic
    assert store.get(7) == b"new"
    now[0] = 1010.0
    assert store.get(7) is None and store.get(2**62) is not None


def test_file_store_is_shared_between_instances(tmp_path: Path) -> None:
    FileKvStore(tmp_path).put(42, b"kv", expires_at=4e9)
    assert FileKvStore(tmp_path).get(42) == b"kv"
    assert not list(tmp_path.rglob("*.tmp"))


def test_tail_hash_is_chained_and_absent_on_block_boundary() -> None:
    salt = kv_salt("m", "f")
    a = list(range(300))
    full = block_hashes(a, salt)
    assert tail_hash(list(range(256)), block_hashes(list(range(256)), salt)) is None
    t = tail_hash(a, full)
    assert t is not None and t not in full and 0 <= t < 2**63
    assert tail_hash([*a[:-1], 9999], full) != t  # covers the tail tokens
    other = [1, *a[1:]]
    assert tail_hash(other, block_hashes(other, salt)) != t  # and the prefix


def test_finish_mapping() -> None:
    assert map_finish("length") == (FinishReason.LENGTH, None, None)
    assert map_finish("xgrammar runtime errors or timeout")[1] is ErrorKind.STRUCTURED_OUTPUT
    assert map_finish("something new")[:2] == (FinishReason.ERROR, ErrorKind.ENGINE)


def test_sampling_kwargs_mirror_sampling_params() -> None:
    s = Sampling(
        temperature=0.0, top_k=5, max_tokens=3, seq_seed=9, so_args=StructuredOutput(schema_type="json", schema_="{}")
    )
    kw = sampling_kwargs(s)
    assert kw["so_args"] == {"schema_type": "json", "schema": "{}"} and kw["seq_seed"] == 9 and "logprobs" not in kw
