"""In-flight prefill reservations, so gateway replicas do not herd onto one worker.

Between two load reports every replica sees the same (stale) queues and would pick the
same "best" worker. Each replica therefore reserves the prompt tokens it sends to a
worker until the worker answers with its first token, and every replica adds all
replicas' reservations to the reported queue when it routes.

- `MemoryInflight`: this process only (single gateway, the demo).
- `RedisInflight`: shared. Per worker, a hash `dgw:inflight:{w}:tok` (request -> tokens)
  and a sorted set `dgw:inflight:{w}:exp` (request -> lease expiry), so reservations of
  a replica that died expire after `lease_s`. `totals()` purges expired leases and sums,
  for all candidates, in ONE script call; `reserve`/`release` are one call each.
  Redis errors degrade to the local view (counted, logged once).

Reservations and load reports overlap for the time a request sits both in the worker's
queue and in a reservation (until its first token); the overlap makes the router
slightly conservative about busy workers, which is the safe direction.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from deepinfer_gateway.outage import Outage


class MemoryInflight:
    def __init__(self) -> None:
        self._tokens: dict[str, dict[str, int]] = {}

    async def totals(self, workers: Sequence[str]) -> dict[str, int]:
        return {w: sum(self._tokens.get(w, {}).values()) for w in workers}

    async def reserve(self, worker: str, request_id: str, tokens: int) -> None:
        self._tokens.setdefault(worker, {})[request_id] = tokens

    async def release(self, worker: str, request_id: str) -> None:
        self._tokens.get(worker, {}).pop(request_id, None)


_TOTALS_LUA = """
local now = tonumber(ARGV[1])
local out = {}
for i, tok in ipairs(KEYS) do
  if i % 2 == 1 then
    local exp = KEYS[i + 1]
    local dead = redis.call('ZRANGEBYSCORE', exp, '-inf', now)
    if #dead > 0 then
      redis.call('ZREMRANGEBYSCORE', exp, '-inf', now)
      redis.call('HDEL', tok, unpack(dead))
    end
    local sum = 0
    for _, v in ipairs(redis.call('HVALS', tok)) do sum = sum + tonumber(v) end
    table.insert(out, sum)
  end
end
return out
"""


def _keys(worker: str) -> tuple[str, str]:
    tag = "{dgw:inflight}"  # one slot: the totals script reads every candidate's keys (Redis Cluster)
    return f"{tag}:{worker}:tok", f"{tag}:{worker}:exp"


class RedisInflight:
    def __init__(self, redis: Any, lease_s: float = 60.0, on_error: Callable[[], None] | None = None):
        self._redis = redis
        self._lease_s = lease_s
        self._totals = redis.register_script(_TOTALS_LUA)
        self._local = MemoryInflight()
        self._outage = Outage("in-flight reservations", "using this replica's own view", on_error)

    async def totals(self, workers: Sequence[str]) -> dict[str, int]:
        if not workers:
            return {}
        keys = [k for w in workers for k in _keys(w)]
        try:
            sums = await self._totals(keys=keys, args=[time.time()])
        except Exception as exc:
            self._outage.failed(exc)
            return await self._local.totals(workers)
        self._outage.ok()
        return {w: int(s) for w, s in zip(workers, sums, strict=True)}

    async def reserve(self, worker: str, request_id: str, tokens: int) -> None:
        await self._local.reserve(worker, request_id, tokens)
        tok, exp = _keys(worker)
        try:
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.hset(tok, request_id, tokens).zadd(exp, {request_id: time.time() + self._lease_s})
                await pipe.execute()
        except Exception as exc:
            self._outage.failed(exc)

    async def release(self, worker: str, request_id: str) -> None:
        await self._local.release(worker, request_id)
        tok, exp = _keys(worker)
        try:
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.hdel(tok, request_id).zrem(exp, request_id)
                await pipe.execute()
        except Exception as exc:
            self._outage.failed(exc)
