"""Test helpers for the KV cache layer: a tiny worker-side event log built from protocol types."""

from __future__ import annotations

from deepinfer_gateway.core.protocol import KvEvent, KvEventBatch, KvEventKind, KvTier


class EventLog:
    """What a worker's KV event log serves: gap-free seqs per epoch, bounded retention."""

    def __init__(self, worker_id: str, epoch: str = "e1", retention: int = 1_000_000) -> None:
        self.worker_id = worker_id
        self.epoch = epoch
        self.retention = retention
        self.events: list[KvEvent] = []
        self.last_seq = 0

    def add(self, kind: KvEventKind, tier: KvTier, hashes: list[int], expires_at: float | None = None) -> KvEvent:
        self.last_seq += 1
        event = KvEvent(seq=self.last_seq, kind=kind, tier=tier, block_hashes=hashes, expires_at=expires_at)
        self.events.append(event)
        del self.events[: max(0, len(self.events) - self.retention)]
        return event

    def store_mem(self, hashes: list[int]) -> KvEvent:
        return self.add(KvEventKind.STORED, KvTier.MEMORY, hashes)

    def evict_mem(self, hashes: list[int]) -> KvEvent:
        return self.add(KvEventKind.EVICTED, KvTier.MEMORY, hashes)

    def store_store(self, hashes: list[int], expires_at: float | None) -> KvEvent:
        return self.add(KvEventKind.STORED, KvTier.STORE, hashes, expires_at)

    def restart(self, epoch: str) -> None:
        self.epoch = epoch
        self.events = []
        self.last_seq = 0
        self.add(KvEventKind.CLEARED, KvTier.MEMORY, [])

    @property
    def oldest_seq(self) -> int:
        return self.events[0].seq if self.events else self.last_seq + 1

    def batch(self, after: int = 0, limit: int = 1_000_000) -> KvEventBatch:
        events = [e for e in self.events if e.seq > after][:limit]
        return KvEventBatch(
            worker_id=self.worker_id,
            epoch=self.epoch,
            events=events,
            last_seq=self.last_seq,
            oldest_seq=self.oldest_seq,
        )

    def only(self, *seqs: int) -> KvEventBatch:
        """A batch holding just these events (to fabricate gaps)."""
        events = [e for e in self.events if e.seq in seqs]
        return KvEventBatch(
            worker_id=self.worker_id,
            epoch=self.epoch,
            events=events,
            last_seq=self.last_seq,
            oldest_seq=self.oldest_seq,
        )
