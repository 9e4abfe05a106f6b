"""KV cache layer: block hashing, the two-tier prefix index, and its event feeder.

    from deepinfer_gateway.kvcache.factory import create_prefix_index
    from deepinfer_gateway.kvcache.hashing import block_hashes, kv_salt

    index = create_prefix_index(settings.redis)    # no url: in-memory
    hashes = {fmt: block_hashes(token_ids, kv_salt(model, fmt)) for fmt in formats}
    overlap = await index.lookup(hashes, {worker_id: kv_format, ...})
    overlap.memory[worker_id], overlap.store[kv_format]   # leading blocks

Modules: hashing (shared with workers; keep this package's import light, workers import
it), types (the `PrefixIndex` seam, `Overlap`, metrics), memory and redis_index (the two
backends), lua (Redis scripts), events (`KvEventFeeder`, polls workers), factory.
Design: docs/kv-index.md.
"""
