"""Per-key rate limits: requests/min and tokens/min, as two token buckets per key scope
(`ApiKey.scope`: the key, or its tenant).

Each bucket holds up to its per-minute limit and refills continuously at limit/60 per
second. `admit(cost)` takes 1 from the request bucket and `cost` from the token bucket when
the request bucket holds >= 1 and the token bucket >= min(cost, limit) (so a request larger
than the whole limit is not blocked forever; the bucket goes negative and the next waits).
A request's tokens are reserved, not counted afterwards: its prompt and its whole `max_tokens`
are taken before it runs, and `refund` gives back the output it did not use, when it ends.
So N concurrent requests cannot together overrun the limit (counting output only as it
ended, they could by N x max_tokens). Each step is one atomic operation: one Lua script in
Redis, one synchronous step in memory.

Backends: in memory (one gateway) and Redis (shared by replicas: one round trip each).
A Redis bucket carries no TTL: the shipped Redis evicts only keys with one (volatile-lru),
and an evicted bucket would be a limit reset; there is one small hash per key scope that
ever made a request. Redis errors fail OPEN (requests pass, the failure is counted and
logged once per outage): an outage of the shared state must not take the API down.
"""

from __future__ import annotations

import hashlib
import math
import time
from dataclasses import dataclass
from typing import Any

from deepinfer_gateway.core.outage import Outage
from deepinfer_gateway.gateway.serving.background import run_in_background


@dataclass(frozen=True)
class Verdict:
    allowed: bool
    retry_after_s: float
    remaining_requests: float | None
    remaining_tokens: float | None
    limit_requests: int | None
    limit_tokens: int | None

    def headers(self) -> dict[str, str]:
        out: dict[str, str] = {}
        if self.limit_requests is not None:
            out["x-ratelimit-limit-requests"] = str(self.limit_requests)
            out["x-ratelimit-remaining-requests"] = str(max(0, math.floor(self.remaining_requests or 0)))
        if self.limit_tokens is not None:
            out["x-ratelimit-limit-tokens"] = str(self.limit_tokens)
            out["x-ratelimit-remaining-tokens"] = str(max(0, math.floor(self.remaining_tokens or 0)))
        if not self.allowed:
            out["retry-after"] = str(max(1, math.ceil(self.retry_after_s)))
        return out


def _refill(level: float | None, elapsed_s: float, limit: int) -> float:
    if level is None:
        return float(limit)
    return min(float(limit), level + elapsed_s * limit / 60.0)


def take(levels: tuple[float | None, float | None], last: float | None, now: float,
         limits: tuple[int | None, int | None], cost: int, requests: int = 1
         ) -> tuple[Verdict, tuple[float | None, ...]]:
    """Pure bucket arithmetic shared (and mirrored in Lua) by both backends. `requests`: 1 to
    admit a request, 0 to take tokens alone (a request admitted already, its tokens now known)."""
    elapsed = 0.0 if last is None else max(0.0, now - last)
    limit_r, limit_t = limits
    r = _refill(levels[0], elapsed, limit_r) if limit_r else None
    t = _refill(levels[1], elapsed, limit_t) if limit_t else None
    wait = 0.0
    if r is not None and limit_r and r < requests:
        wait = max(wait, (requests - r) * 60.0 / limit_r)
    need_t = min(cost, limit_t) if limit_t else 0
    if t is not None and limit_t and t < need_t:
        wait = max(wait, (need_t - t) * 60.0 / limit_t)
    allowed = wait == 0.0
    if allowed:
        r = r - requests if r is not None else None
        t = t - cost if t is not None else None
    return Verdict(allowed, wait, r, t, limit_r, limit_t), (r, t)


class MemoryRateLimiter:
    def __init__(self) -> None:
        self._buckets: dict[str, tuple[float | None, float | None, float]] = {}

    async def admit(self, key: str, limits: tuple[int | None, int | None], cost: int, requests: int = 1) -> Verdict:
        r, t, last = self._buckets.get(key, (None, None, None))
        now = time.monotonic()
        verdict, (r2, t2) = take((r, t), last, now, limits, cost, requests)
        self._buckets[key] = (r2, t2, now)
        return verdict

    async def refund(self, key: str, limit_t: int, tokens: int) -> None:
        if key in self._buckets and tokens:
            r, t, last = self._buckets[key]
            self._buckets[key] = (r, None if t is None else min(float(limit_t), t + tokens), last)


# Mirrors `take`; KEYS[1]=bucket; ARGV: limit_r (0=none), limit_t (0=none), cost, requests.
# The clock is the Redis server's: with each caller's own clock, a call carrying an earlier time
# (another replica's clock behind, or a call that reached Redis after a later one) moved the
# bucket's time back, and the next call refilled the same interval again: admits past the limit.
_ADMIT_LUA = """
local h = redis.call('HMGET', KEYS[1], 'r', 't', 'ts')
local clock = redis.call('TIME')
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1e6
local lr, lt, cost, requests = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local elapsed = 0
if h[3] then elapsed = math.max(0, now - tonumber(h[3])) end
local function refill(level, limit)
  if not level then return limit end
  return math.min(limit, tonumber(level) + elapsed * limit / 60.0)
end
local r, t = nil, nil
if lr > 0 then r = refill(h[1], lr) end
if lt > 0 then t = refill(h[2], lt) end
local wait = 0
if r and r < requests then wait = math.max(wait, (requests - r) * 60.0 / lr) end
local need = 0
if lt > 0 then need = math.min(cost, lt) end
if t and t < need then wait = math.max(wait, (need - t) * 60.0 / lt) end
if wait == 0 then
  if r then r = r - requests end
  if t then t = t - cost end
end
local fields = {'ts', tostring(now)}
if r then table.insert(fields, 'r'); table.insert(fields, tostring(r)) end
if t then table.insert(fields, 't'); table.insert(fields, tostring(t)) end
redis.call('HSET', KEYS[1], unpack(fields))
return {tostring(wait), tostring(r or ''), tostring(t or '')}
"""

# KEYS[1]=bucket; ARGV: limit_t, tokens. Unused reserved tokens back, never above the limit.
_REFUND_LUA = """
local t = redis.call('HGET', KEYS[1], 't')
if not t then return 0 end
redis.call('HSET', KEYS[1], 't', tostring(math.min(tonumber(ARGV[1]), tonumber(t) + tonumber(ARGV[2]))))
return 1
"""


def bucket_key(scope: str) -> str:
    """One key per scope, its own hash slot; a digest, as a tenant's name may hold any character."""
    return "dgw:rl:{" + hashlib.sha256(scope.encode()).hexdigest()[:32] + "}"


class RedisRateLimiter:
    def __init__(self, redis: Any, on_error: Any = None, retry_interval_s: float = 1.0):
        self._redis = redis
        self._script = redis.register_script(_ADMIT_LUA)
        self._refund = redis.register_script(_REFUND_LUA)
        self._outage = Outage("rate limiter", "failing open", on_error, retry_interval_s)

    async def admit(self, key: str, limits: tuple[int | None, int | None], cost: int, requests: int = 1) -> Verdict:
        limit_r, limit_t = limits
        if not self._outage.due():  # fail open at once while Redis is known to be failing
            return Verdict(True, 0.0, None, None, limit_r, limit_t)
        try:
            wait, r, t = await self._script(keys=[bucket_key(key)], args=[limit_r or 0, limit_t or 0, cost,
                                                                                requests])
        except Exception as exc:  # fail open
            self._outage.failed(exc)
            return Verdict(True, 0.0, None, None, limit_r, limit_t)
        self._outage.ok()
        wait_s = float(wait)
        return Verdict(wait_s == 0.0, wait_s, float(r) if r else None, float(t) if t else None, limit_r, limit_t)

    async def refund(self, key: str, limit_t: int, tokens: int) -> None:
        if not tokens or not self._outage.due():
            return
        try:
            await self._refund(keys=[bucket_key(key)], args=[limit_t, tokens])
        except Exception as exc:
            self._outage.failed(exc)


class Reservation:
    """A request's output tokens taken before it ran (with its prompt's): `settle` gives back
    what it did not use, once, however the request ended."""

    def __init__(self, limiter: MemoryRateLimiter | RedisRateLimiter, scope: str, limit_t: int, output_tokens: int):
        self._limiter, self._scope, self._limit_t = limiter, scope, limit_t
        self.output_tokens = output_tokens
        self.settled = False

    def settle(self, completion_tokens: int) -> None:
        if self.settled:
            return
        self.settled = True
        unused = self.output_tokens - completion_tokens
        if unused > 0:
            run_in_background(self._limiter.refund(self._scope, self._limit_t, unused))
