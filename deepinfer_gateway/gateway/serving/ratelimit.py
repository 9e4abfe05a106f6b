"""Per-key rate limits: requests/min and tokens/min, as two token buckets per API key.

Each bucket holds up to its per-minute limit and refills continuously at limit/60 per
second. A request is admitted when the request bucket holds >= 1 and the token bucket
holds >= min(prompt tokens, limit) (so a prompt larger than the whole limit is not
blocked forever); admission subtracts the prompt tokens, and the output tokens are
debited when the request ends (the bucket may go negative: the next request waits).

Backends: in memory (one gateway) and Redis (shared by replicas: one Lua script, one
round trip, atomic). Redis errors fail OPEN (requests pass, the failure is counted and
logged once per outage): an outage of the shared state must not take the API down.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

from deepinfer_gateway.outage import Outage


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
         limits: tuple[int | None, int | None], prompt_tokens: int) -> tuple[Verdict, tuple[float | None, ...]]:
    """Pure bucket arithmetic shared (and mirrored in Lua) by both backends."""
    elapsed = 0.0 if last is None else max(0.0, now - last)
    limit_r, limit_t = limits
    r = _refill(levels[0], elapsed, limit_r) if limit_r else None
    t = _refill(levels[1], elapsed, limit_t) if limit_t else None
    wait = 0.0
    if r is not None and limit_r and r < 1:
        wait = max(wait, (1 - r) * 60.0 / limit_r)
    need_t = min(prompt_tokens, limit_t) if limit_t else 0
    if t is not None and limit_t and t < need_t:
        wait = max(wait, (need_t - t) * 60.0 / limit_t)
    allowed = wait == 0.0
    if allowed:
        r = r - 1 if r is not None else None
        t = t - prompt_tokens if t is not None else None
    return Verdict(allowed, wait, r, t, limit_r, limit_t), (r, t)


class MemoryRateLimiter:
    def __init__(self) -> None:
        self._buckets: dict[str, tuple[float | None, float | None, float]] = {}

    async def admit(self, key: str, limits: tuple[int | None, int | None], prompt_tokens: int) -> Verdict:
        r, t, last = self._buckets.get(key, (None, None, None))
        now = time.monotonic()
        verdict, (r2, t2) = take((r, t), last, now, limits, prompt_tokens)
        self._buckets[key] = (r2, t2, now)
        return verdict

    async def debit(self, key: str, tokens: int) -> None:
        if key in self._buckets and tokens:
            r, t, last = self._buckets[key]
            self._buckets[key] = (r, None if t is None else t - tokens, last)


# Mirrors `take`; KEYS[1]=bucket; ARGV: limit_r (0=none), limit_t (0=none), prompt_tokens, ttl_s.
# The clock is the Redis server's: with each caller's own clock, a call carrying an earlier time
# (another replica's clock behind, or a call that reached Redis after a later one) moved the
# bucket's time back, and the next call refilled the same interval again: admits past the limit.
_ADMIT_LUA = """
local h = redis.call('HMGET', KEYS[1], 'r', 't', 'ts')
local clock = redis.call('TIME')
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1e6
local lr, lt, cost = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
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
if r and r < 1 then wait = math.max(wait, (1 - r) * 60.0 / lr) end
local need = 0
if lt > 0 then need = math.min(cost, lt) end
if t and t < need then wait = math.max(wait, (need - t) * 60.0 / lt) end
if wait == 0 then
  if r then r = r - 1 end
  if t then t = t - cost end
end
local fields = {'ts', tostring(now)}
if r then table.insert(fields, 'r'); table.insert(fields, tostring(r)) end
if t then table.insert(fields, 't'); table.insert(fields, tostring(t)) end
redis.call('HSET', KEYS[1], unpack(fields))
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[4]))
return {tostring(wait), tostring(r or ''), tostring(t or '')}
"""


class RedisRateLimiter:
    def __init__(self, redis: Any, on_error: Any = None, retry_interval_s: float = 1.0):
        self._redis = redis
        self._script = redis.register_script(_ADMIT_LUA)
        self._outage = Outage("rate limiter", "failing open", on_error, retry_interval_s)

    async def admit(self, key: str, limits: tuple[int | None, int | None], prompt_tokens: int) -> Verdict:
        limit_r, limit_t = limits
        if not self._outage.due():  # fail open at once while Redis is known to be failing
            return Verdict(True, 0.0, None, None, limit_r, limit_t)
        try:
            wait, r, t = await self._script(keys=[f"dgw:rl:{{{key}}}"],
                                            args=[limit_r or 0, limit_t or 0, prompt_tokens, 180])
        except Exception as exc:  # fail open
            self._outage.failed(exc)
            return Verdict(True, 0.0, None, None, limit_r, limit_t)
        self._outage.ok()
        wait_s = float(wait)
        return Verdict(wait_s == 0.0, wait_s, float(r) if r else None, float(t) if t else None, limit_r, limit_t)

    async def debit(self, key: str, tokens: int) -> None:
        if not tokens or not self._outage.due():
            return
        try:
            bucket = f"dgw:rl:{{{key}}}"
            if await self._redis.hexists(bucket, "t"):
                await self._redis.hincrbyfloat(bucket, "t", -tokens)
        except Exception as exc:
            self._outage.failed(exc)
