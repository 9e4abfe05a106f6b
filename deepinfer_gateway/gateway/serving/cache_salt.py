"""The prefix-cache salt of a request: which other requests may share its KV blocks.

Without one, every request of a model shares cached prefixes with every other, so a
tenant's `cached_tokens` tells it whether its guess of another tenant's prompt is cached.
A salt (vLLM's `cache_salt`) gives the request a block-hash chain of its own
(kvcache.hashing.kv_salt): the router's index and the worker's prefix cache then match it
only against requests with the same salt. Two sources, combined so neither can stand in
for the other: the key's isolation (`cache_isolation`: its tenant, else the key itself)
and the client's `cache_salt` field. The workers get an opaque digest, never the tenant.
"""

from __future__ import annotations

import hashlib
import json

from deepinfer_gateway.config import ApiKey


def request_cache_salt(key: ApiKey, client_salt: str | None) -> str | None:
    """None (shared with every unsalted request) unless the key isolates its cache or the client
    sent `cache_salt`; else a digest of both (a client salt never spells another key's)."""
    isolation = key.scope if key.cache_isolation else None
    if isolation is None and client_salt is None:
        return None
    return hashlib.sha256(json.dumps([isolation, client_salt]).encode()).hexdigest()
