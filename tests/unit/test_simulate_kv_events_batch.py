"""A sim worker's KV event batch, built without validation, equals the validated models."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer_gateway.core.protocol import KvEvent, KvEventBatch, KvEventKind, KvTier
from deepinfer_gateway.workers.sim.kv_events import SimKvEventLog

_ROWS = st.lists(st.tuples(st.sampled_from(list(KvEventKind)), st.sampled_from(list(KvTier)),
                           st.lists(st.integers(0, 2**63 - 1), max_size=4),
                           st.one_of(st.none(), st.integers(0, 10**6), st.floats(0, 1e9))), max_size=8)


@settings(max_examples=100, deadline=None)
@given(_ROWS, st.integers(0, 10), st.integers(1, 10))
def test_batch_equals_the_validated_batch(rows: list[tuple[KvEventKind, KvTier, list[int], float | None]],
                                          after: int, limit: int) -> None:
    log = SimKvEventLog("w", retention=5)
    for kind, tier, hashes, expires in rows:
        log.append(kind, tier, hashes, expires)
    batch = log.batch(after, limit)
    validated = KvEventBatch(worker_id=batch.worker_id, epoch=batch.epoch, last_seq=batch.last_seq,
                             oldest_seq=batch.oldest_seq,
                             events=[KvEvent(**event.model_dump()) for event in batch.events])
    assert batch == validated
    assert batch.model_dump_json() == validated.model_dump_json()
    assert all(type(e.expires_at) is float for e in batch.events if e.expires_at is not None)
