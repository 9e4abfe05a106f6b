"""Oracle prefix hit rate of a hash-id trace: one infinite global cache.

Definition: requests are replayed in arrival order (equal timestamps keep file order).
Block i of a request is a hit only if blocks 0..i were all seen before, as the same
prefix chain, in an earlier request; the first miss ends the request's hits.
Token-weighted: block i holds min(block_size, input_length - block_size*i) tokens; the
denominator is the sum of input_length. O(total blocks) time and memory.
"""

from __future__ import annotations

from collections.abc import Iterable

from deepinfer_gateway.workload.types import TraceRequest


def oracle_hit_rate(requests: Iterable[TraceRequest], block_size: int) -> float | None:
    """Token-weighted oracle hit rate, or None when any request lacks hash ids."""
    chains: dict[tuple[int, int], int] = {}  # (parent chain, block id) -> chain id
    seen: set[int] = set()
    hit_tokens = total_tokens = 0
    for request in sorted(requests, key=lambda r: r.arrival_s):
        if request.hash_ids is None:
            return None
        total_tokens += request.input_length
        parent = -1
        hitting = True
        mine: list[int] = []
        for i, block_id in enumerate(request.hash_ids):
            chain = chains.setdefault((parent, block_id), len(chains))
            mine.append(chain)
            if hitting and chain in seen:
                hit_tokens += max(0, min(block_size, request.input_length - block_size * i))
            else:
                hitting = False
            parent = chain
        seen.update(mine)
    return hit_tokens / total_tokens if total_tokens else None
