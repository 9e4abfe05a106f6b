"""In-flight prefill reservations, so gateway replicas do not herd onto one worker.

Between two load reports every replica sees the same (stale) queues and would pick the
same "best" worker. Each replica therefore reserves the prompt tokens it sends to a
worker until the worker answers with its first token, and every replica adds all
replicas' reservations to the reported queue when it routes.

- `MemoryInflight`: this process only (single gateway, the demo).
- `RedisInflight`: shared. Per worker, a hash `dgw:inflight:{w}:tok` (request -> tokens)
  and a sorted set `dgw:inflight:{w}:exp` (request -> lease expiry), so reservations of
  a replica that died expire after `lease_s`. `totals()` purges expired leases and sums,
  for all candidates, in ONE script call. `reserve`/`release` do not wait for Redis: they
  queue a write, and one writer task at a time sends every queued write in ONE script
  call, in order (a reservation whose release is queued with it is never sent: the
  request already got its first token). Under load one call carries many requests'
  writes; alone, a request costs one call (reserve, release each landing separately)
  instead of two MULTI/EXEC transactions, each ~1.5x a script call's client CPU with
  redis-py. Until its write is acknowledged, a replica's own reservation is added to
  `totals()` from its local view (so for one round trip it may count twice: the safe
  direction, a busy worker looks a little busier). Redis errors degrade to the local view
  (counted, logged once), at once for every request while Redis is failing (outage.py).

What a request books and when: router/booking.py (`Booking`; these stores are its `Reservations`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

from deepinfer_gateway.core.outage import Outage


class MemoryInflight:
    def __init__(self) -> None:
        self._tokens: dict[str, dict[str, int]] = {}
        self._sums: dict[str, int] = {}  # per worker, kept with `_tokens`: read on every request's route

    async def totals(self, workers: Sequence[str]) -> dict[str, int]:
        return {w: self._sums.get(w, 0) for w in workers}

    def own(self, worker: str) -> int:
        """This process's bookings on `worker`, now."""
        return self._sums.get(worker, 0)

    def reserve(self, worker: str, request_id: str, tokens: int) -> None:
        booked = self._tokens.setdefault(worker, {})
        self._sums[worker] = self._sums.get(worker, 0) + tokens - booked.get(request_id, 0)
        booked[request_id] = tokens

    def release(self, worker: str, request_id: str) -> None:
        tokens = self._tokens.get(worker, {}).pop(request_id, None)
        if tokens is not None:
            self._sums[worker] -= tokens

    async def flush(self) -> None:
        return None  # nothing is queued


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


# KEYS: per write, the worker's (tok, exp); ARGV: lease expiry, then per write (request, tokens);
# tokens "" = a release.
_WRITE_LUA = """
local expiry = ARGV[1]
for i = 1, #KEYS, 2 do
  local request, tokens = ARGV[i + 1], ARGV[i + 2]
  if tokens == '' then
    redis.call('HDEL', KEYS[i], request)
    redis.call('ZREM', KEYS[i + 1], request)
  else
    redis.call('HSET', KEYS[i], request, tokens)
    redis.call('ZADD', KEYS[i + 1], expiry, request)
  end
end
return 1
"""


def _keys(worker: str) -> tuple[str, str]:
    tag = "{dgw:inflight}"  # one slot: the totals script reads every candidate's keys (Redis Cluster)
    return f"{tag}:{worker}:tok", f"{tag}:{worker}:exp"


class RedisInflight:
    def __init__(self, redis: Any, lease_s: float = 60.0, on_error: Callable[[], None] | None = None,
                 retry_interval_s: float = 1.0):
        self._redis = redis
        self._lease_s = lease_s
        self._totals = redis.register_script(_TOTALS_LUA)
        self._write = redis.register_script(_WRITE_LUA)
        self._local = MemoryInflight()
        self._outage = Outage("in-flight reservations", "using this replica's own view", on_error, retry_interval_s)
        # Queued writes by request (insertion order = write order): (worker, tokens), tokens
        # None for a release.
        self._queued: dict[tuple[str, str], int | None] = {}
        self._unsent: dict[str, dict[str, int]] = {}  # reservations not yet known to land: worker -> request -> tokens
        self._sent: set[tuple[str, str]] = set()  # (worker, request) with a reservation sent to Redis
        self._written: dict[tuple[str, str], int] = {}  # (worker, request) -> tokens Redis acknowledged
        self._writer: asyncio.Task[None] | None = None

    async def totals(self, workers: Sequence[str]) -> dict[str, int]:
        if not workers:
            return {}
        if not self._outage.due():
            return await self._local.totals(workers)
        keys = [k for w in workers for k in _keys(w)]
        try:
            sums = await self._totals(keys=keys, args=[time.time()])
        except Exception as exc:
            self._outage.failed(exc)
            return await self._local.totals(workers)
        self._outage.ok()
        unsent, written = self._unsent, self._written
        # A re-booking not yet landed replaces what Redis holds for the request.
        return {w: int(s) + (sum(t - written.get((w, r), 0) for r, t in unsent[w].items()) if w in unsent else 0)
                for w, s in zip(workers, sums, strict=True)}

    def own(self, worker: str) -> int:
        return self._local.own(worker)

    def reserve(self, worker: str, request_id: str, tokens: int) -> None:
        self._local.reserve(worker, request_id, tokens)
        self._unsent.setdefault(worker, {})[request_id] = tokens
        self._queue(worker, request_id, tokens)

    def release(self, worker: str, request_id: str) -> None:
        self._local.release(worker, request_id)
        self._landed(worker, request_id)
        key = (worker, request_id)
        if self._queued.get(key) is not None and key not in self._sent:
            del self._queued[key]  # reserved and released before the writer ran: nothing to send
            return
        self._queue(worker, request_id, None)

    async def flush(self) -> None:
        """Wait until every write queued so far has been sent (or failed)."""
        while self._writer is not None:
            await asyncio.shield(self._writer)

    def _queue(self, worker: str, request_id: str, tokens: int | None) -> None:
        self._queued[(worker, request_id)] = tokens
        if self._writer is None:
            self._writer = asyncio.get_running_loop().create_task(self._send_queued())

    async def _send_queued(self) -> None:
        """The one writer: sends what is queued, again while more was queued meanwhile."""
        try:
            while self._queued:
                writes, self._queued = self._queued, {}
                keys: list[str] = []
                args: list[Any] = [time.time() + self._lease_s]
                sent, written = self._sent, self._written
                for (worker, request_id), tokens in writes.items():
                    keys += _keys(worker)
                    args += [request_id, "" if tokens is None else tokens]
                    if tokens is None:
                        sent.discard((worker, request_id))
                    else:
                        sent.add((worker, request_id))
                try:
                    await self._write(keys=keys, args=args)
                except Exception as exc:  # the leases expire; the local view carries on
                    self._outage.failed(exc)
                else:
                    self._outage.ok()
                for (worker, request_id), tokens in writes.items():
                    if tokens is None:
                        written.pop((worker, request_id), None)
                    else:
                        written[worker, request_id] = tokens
                        self._landed(worker, request_id, tokens)
        finally:
            self._writer = None

    def _landed(self, worker: str, request_id: str, tokens: int | None = None) -> None:
        """`totals()` stops adding this reservation from the local view (written, failed or
        released); `tokens`: the amount written, kept in the local view when it changed meanwhile."""
        unsent = self._unsent.get(worker)
        if unsent is None or (tokens is not None and unsent.get(request_id, tokens) != tokens):
            return
        if unsent.pop(request_id, None) is not None and not unsent:
            del self._unsent[worker]
