"""API keys: who is calling, which models they may use, and their workload class.

Keys are never stored in clear: configuration (and Redis) hold the SHA-256 hex digest;
a presented key is hashed and looked up. Clients present keys the way their SDK does:
`Authorization: Bearer KEY` (OpenAI) or `x-api-key: KEY` (Anthropic).

With no key configured, authentication is off (the demo); the caller is `anonymous`
with the default workload class.

Keys may also live in Redis (hash `dgw:apikey:{sha256}` with fields name, models
(comma-separated), workload_class, requests_per_minute, tokens_per_minute, admin, tenant,
cache_isolation, service_tier) so
an operator can add one without restarting any gateway replica. Lookups are cached for
`cache_ttl_s`: keys found in one cache, keys not found in another, each holding at most
`cache_size` (oldest dropped first), so clients presenting random keys can neither grow the
memory nor push a real key out. While Redis fails, a key found before keeps its last record,
without waiting for Redis (outage.py); a key last seen absent (revoked, or never added) stays
refused (401); a key never seen is answered 503 (`KeysUnavailable`), not 401: nobody can tell
yet whether it is valid, and a client told its key is invalid stops retrying. A failed lookup
is not cached. A key revoked in Redis stops working within `cache_ttl_s`, on every replica
that can reach Redis.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from deepinfer_gateway.config import ApiKey
from deepinfer_gateway.core.errors import GatewayError
from deepinfer_gateway.core.outage import Outage

ANONYMOUS = ApiKey(name="anonymous", key_sha256="0" * 64)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def presented_key(headers: Any) -> str | None:
    authorization = headers.get("authorization")
    if authorization and authorization.lower().startswith("bearer "):
        return authorization[7:].strip() or None
    return headers.get("x-api-key") or None


class KeysUnavailable(GatewayError):
    status_code = 503

    def __init__(self, message: str):
        super().__init__(message, headers={"retry-after": "1"})


class KeyStore:
    def __init__(self, keys: tuple[ApiKey, ...], redis: Any = None, cache_ttl_s: float = 10.0,
                 cache_size: int = 10_000, on_error: Callable[[], None] | None = None):
        self._keys = {k.key_sha256: k for k in keys}
        self._redis = redis
        # digest -> (expires, record) / expires; oldest first. Apart, so that absent keys (any
        # client can send millions) never push out the records of real ones.
        self._found: OrderedDict[str, tuple[float, ApiKey]] = OrderedDict()
        self._absent: OrderedDict[str, float] = OrderedDict()
        self._cache_ttl_s = cache_ttl_s
        self._cache_size = cache_size
        self._outage = Outage("API keys", "configured and recently seen keys only", on_error)
        self.enabled = bool(keys) or redis is not None

    async def lookup(self, key: str | None) -> ApiKey | None:
        """The key's record, ANONYMOUS when auth is off, None when unknown."""
        if not self.enabled:
            return ANONYMOUS
        if not key:
            return None
        digest = hash_key(key)
        configured = self._keys.get(digest)
        if configured is not None or self._redis is None:
            return configured
        now = time.monotonic()
        found = self._found.get(digest)
        if found is not None and found[0] > now:
            return found[1]
        absent_until = self._absent.get(digest)
        if absent_until is not None and absent_until > now:
            return None
        if not self._outage.due():
            return self._last_known(digest)
        try:
            record = await self._from_redis(digest)
        except Exception as exc:  # configured keys still work; others keep their last record
            self._outage.failed(exc)
            return self._last_known(digest)
        self._outage.ok()
        self._remember(digest, record, now)
        return record

    def _last_known(self, digest: str) -> ApiKey | None:
        """While Redis cannot answer: a key's last record; None when it was last seen absent."""
        found = self._found.get(digest)
        if found is not None:
            return found[1]
        if digest in self._absent:
            return None
        raise KeysUnavailable("API keys cannot be checked right now (their store is unreachable); retry shortly.")

    def _remember(self, digest: str, record: ApiKey | None, now: float) -> None:
        expires = now + self._cache_ttl_s
        # One entry per digest: a key found absent (revoked) loses its record, so no outage revives it.
        self._found.pop(digest, None)
        self._absent.pop(digest, None)
        if record is not None:
            self._found[digest] = (expires, record)  # inserted last: the order is the order of expiry
            cache: OrderedDict[str, Any] = self._found
        else:
            self._absent[digest] = expires
            cache = self._absent
        while len(cache) > self._cache_size:
            cache.popitem(last=False)

    async def _from_redis(self, digest: str) -> ApiKey | None:
        fields = await self._redis.hgetall(f"dgw:apikey:{digest}")
        if not fields:
            return None
        f = {k.decode() if isinstance(k, bytes) else k: v.decode() if isinstance(v, bytes) else v
             for k, v in fields.items()}
        return ApiKey(
            name=f.get("name", digest[:8]), key_sha256=digest,
            models=tuple(m for m in f.get("models", "").split(",") if m),
            workload_class=f.get("workload_class", "chat"),
            requests_per_minute=int(f["requests_per_minute"]) if f.get("requests_per_minute") else None,
            tokens_per_minute=int(f["tokens_per_minute"]) if f.get("tokens_per_minute") else None,
            admin=f.get("admin", "false").lower() in ("1", "true", "yes"),
            tenant=f.get("tenant") or None,
            cache_isolation=f.get("cache_isolation", "false").lower() in ("1", "true", "yes"),
            service_tier=f.get("service_tier") or "default",
        )
