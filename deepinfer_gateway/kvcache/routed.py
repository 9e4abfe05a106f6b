"""Prompts just routed, counted as cached on their worker until its KV events can say so.

A worker reports a prompt's blocks `stored` only once it has computed them: for a prompt's
prefill and one events interval after, the index does not know them. Requests that share a
prefix and arrive together (agent sessions starting at once with one system prompt, a burst of
retries) would each see it cached nowhere and spread over the workers, each computing it again.
A router that learns from its own routing (SGLang's tree) sends them after the first; this does
the same for that window only: each routed prompt's block hashes count as its worker's memory
tier for `ttl_s`, the larger of this and the index's overlap winning (`merged`).

Per process (replicas on one Redis do not share it) and volatile. Bounded: `max_blocks`
hashes, the oldest dropped first. Pure: the clock is a parameter.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence

from deepinfer_gateway.kvcache.types import Overlap

DEFAULT_MAX_BLOCKS = 200_000  # ~20 MB; at a 2 s TTL, 12.8M tokens routed a second


class RoutedPrefixes:
    def __init__(self, ttl_s: float, max_blocks: int = DEFAULT_MAX_BLOCKS) -> None:
        self.ttl_s = ttl_s
        self.max_blocks = max_blocks
        self._until: dict[str, dict[int, float]] = {}  # worker -> block hash -> when it stops counting
        self._added: deque[tuple[float, str, int]] = deque()  # (until, worker, hash), oldest first

    def add(self, worker: str, hashes: Sequence[int], now: float) -> None:
        """The prompt of `hashes` (its blocks, leading first) was sent to `worker`."""
        until = now + self.ttl_s
        blocks = self._until.setdefault(worker, {})
        added = self._added
        for h in hashes:
            blocks[h] = until
            added.append((until, worker, h))
        self._trim(now)

    def leading(self, worker: str, hashes: Sequence[int], now: float) -> int:
        """Leading blocks of `hashes` routed to `worker` within the TTL."""
        blocks = self._until.get(worker)
        if not blocks:
            return 0
        n = 0
        for h in hashes:
            if blocks.get(h, 0.0) <= now:
                break
            n += 1
        return n

    def merged(self, overlap: Overlap, hashes: Mapping[str, Sequence[int]], workers: Mapping[str, str],
               now: float) -> Overlap:
        """`overlap` with each worker's memory tier at least what was routed to it (`workers`:
        worker id -> its KV format, whose hashes in `hashes` are its prompt's)."""
        memory: dict[str, int] | None = None
        for worker, kv_format in workers.items():
            if worker not in self._until:
                continue
            routed = self.leading(worker, hashes.get(kv_format, ()), now)
            if routed > overlap.memory.get(worker, 0):
                if memory is None:
                    memory = dict(overlap.memory)
                memory[worker] = routed
        return overlap if memory is None else Overlap(memory, overlap.store)

    def _trim(self, now: float) -> None:
        added, until = self._added, self._until
        while added and (added[0][0] <= now or len(added) > self.max_blocks):
            expiry, worker, h = added.popleft()
            blocks = until.get(worker)
            if blocks is not None and blocks.get(h) == expiry:  # not routed again since
                del blocks[h]
                if not blocks:
                    del until[worker]
