"""The prefix index seam: one narrow async interface, the answer type, its metrics.

Leaf module (imports only the protocol). Backends: `memory.InMemoryPrefixIndex`
(embedded default, one process) and `redis_index.RedisPrefixIndex` (shared by gateway
replicas); build either with `kvcache.create_prefix_index`. Both pass one contract test
suite (tests/e2e/test_kv_index_contract.py).

Semantics every backend keeps:
- Memory tier: per worker, the set of block hashes it reported `stored` and not
  `evicted`. Fed in per-worker `seq` order; a new `epoch`, an event gap, or falling
  behind the worker's retained log (`oldest_seq`) drops the worker's memory tier and
  re-reads from the worker's oldest retained event (`apply` returns the cursor to poll).
  Under-prediction is the only failure mode this allows: the router then routes as if
  the blocks were cold.
- Store tier: one shared set of block hashes with an expiry each (`expires_at` from the
  event, else `default_store_ttl_s`). Hashes are salted by kv_format, so one set serves
  every format without mixing them.
- Lookup counts LEADING blocks only: a block is useful only if every block before it is
  also present.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from prometheus_client import CollectorRegistry, Counter

from deepinfer_gateway.core.protocol import STORE_TTL_S, KvEventBatch

DEFAULT_STORE_TTL_S = STORE_TTL_S["chat"]  # workers normally send expires_at


@dataclass(frozen=True, slots=True)
class Overlap:
    """How much of a prompt is cached where, in blocks (multiply by block_tokens for tokens).

    memory: candidate worker_id -> leading blocks in that worker's memory.
    store: kv_format -> leading blocks in the shared store for that format's hashes.
    """

    memory: Mapping[str, int] = field(default_factory=dict)
    store: Mapping[str, int] = field(default_factory=dict)


@runtime_checkable
class PrefixIndex(Protocol):
    async def apply(self, worker_id: str, batch: KvEventBatch) -> int:
        """Ingest one polled batch; return the cursor to poll next (`after=`).

        0 means "re-read from the worker's oldest retained event": the worker's memory
        tier was dropped because of a new epoch or a gap the batch could not bridge.
        """
        ...

    async def remove_worker(self, worker_id: str) -> None:
        """Forget a worker (deregistered or gone): its memory tier and cursor."""
        ...

    async def lookup(self, hashes: Mapping[str, Sequence[int]], workers: Mapping[str, str]) -> Overlap:
        """Leading cached blocks for one prompt.

        hashes: kv_format -> the prompt's block hashes salted for that format.
        workers: candidate worker_id -> its kv_format (workers whose format has no
        entry in `hashes` get 0). Every format in `hashes` gets a store count.
        """
        ...

    async def stats(self) -> dict[str, Any]:
        """Operator view (`GET /admin/index`): `backend`, per worker its memory-tier block
        count and event cursor, `store_entries`; backends add their own details."""
        ...

    async def aclose(self) -> None: ...


# The Redis prefix index's operations: the `op` label of dgw_kv_index_errors_total.
INDEX_OPS = ("apply", "lookup", "remove_worker")


class KvIndexMetrics:
    """`dgw_kv_index_errors_total{op}` and `dgw_kv_index_writes_deferred_total` in the
    caller's registry (a private one if none)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self.errors = Counter(
            "dgw_kv_index_errors_total",
            "Prefix index backend failures (served from the local view meanwhile).",
            ["op"],
            registry=self.registry,
        )
        for op in INDEX_OPS:
            self.errors.labels(op=op)  # at 0 from the start: the first failure is an increase
        self.writes_deferred = Counter(
            "dgw_kv_index_writes_deferred",
            "Event batches applied to the local view only: another replica holds the worker's write lease.",
            registry=self.registry,
        )

    def error(self, op: str) -> None:
        self.errors.labels(op=op).inc()

    def error_count(self, op: str) -> float:
        value = self.registry.get_sample_value("dgw_kv_index_errors_total", {"op": op})
        return value or 0.0
