"""The Redis index's Lua scripts and a one-round-trip script runner.

Scripts touch only keys passed in KEYS (all under one hash tag: Redis Cluster safe).
Block hashes travel as one blob of 8-byte little-endian words per event or prompt (one
argument instead of a thousand), split with string.sub inside Redis; set and zset
members are those 8-byte strings.

`Script.run` sends EVALSHA (EVALSHA_RO for lookups, which Redis may serve from a
replica) and falls back to EVAL only when Redis answers NOSCRIPT (a restarted Redis):
one round trip in the steady state, two right after a restart.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import NoScriptError

_HELPERS = """
local function split(blob)
  local t = {}
  for i = 1, #blob, 8 do t[#t + 1] = string.sub(blob, i, i + 7) end
  return t
end
local function each_chunk(t, fn)
  for i = 1, #t, 4000 do fn(unpack(t, i, math.min(i + 3999, #t))) end
end
"""

# KEYS: mem, cur, store (zset: expiry), store_set (set: membership), alive, writer (lease)
# ARGV: epoch, oldest_seq, now, mem_cap, store_cap, idle_ttl_ms, default_expires_at,
#       replica id, lease_ms (0: no lease),
#       then per event: seq, code (ms|me|mc|ss|se|sc), expires_at or "", hashes blob
# Returns {status, last_seq}: 0 applied, 1 gap (push a snapshot), 2 Redis lost its data;
# or {3, lease ms left}: another replica holds this worker's write lease (nothing applied).
# The sequencing rule mirrors memory.InMemoryPrefixIndex.apply_now.
APPLY_SCRIPT = (
    _HELPERS
    + """
local lease_ms = tonumber(ARGV[9])
if lease_ms > 0 then
  local holder = redis.call('GET', KEYS[6])
  if holder and holder ~= ARGV[8] then return {3, redis.call('PTTL', KEYS[6])} end
  redis.call('SET', KEYS[6], ARGV[8], 'PX', lease_ms)
end
if redis.call('EXISTS', KEYS[5]) == 0 then
  redis.call('SET', KEYS[5], '1')
  return {2, -1}
end
local epoch, oldest, now = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local cur = redis.call('HMGET', KEYS[2], 'e', 's')
local last = -1
if cur[1] == epoch then
  last = tonumber(cur[2])
else
  redis.call('UNLINK', KEYS[1])
end
if last ~= -1 and oldest > last + 1 then
  redis.call('UNLINK', KEYS[1]); last = -1
end
local function accepts(seq)
  if last == -1 then return seq == 1 or seq == oldest end
  return seq == last + 1
end
local status = 0
for i = 10, #ARGV, 4 do
  local seq = tonumber(ARGV[i])
  if last == -1 or seq > last then
    if not accepts(seq) then
      redis.call('UNLINK', KEYS[1]); last = -1
      if not accepts(seq) then status = 1; break end
    end
    local code, hs = ARGV[i + 1], split(ARGV[i + 3])
    if code == 'ms' then
      each_chunk(hs, function(...) redis.call('SADD', KEYS[1], ...) end)
    elseif code == 'me' then
      each_chunk(hs, function(...) redis.call('SREM', KEYS[1], ...) end)
    elseif code == 'mc' then
      redis.call('UNLINK', KEYS[1])
    elseif code == 'ss' then
      local exp = ARGV[i + 2]
      if exp == '' then exp = ARGV[7] end
      local args = {}
      for _, h in ipairs(hs) do args[#args + 1] = exp; args[#args + 1] = h end
      each_chunk(args, function(...) redis.call('ZADD', KEYS[3], ...) end)
      each_chunk(hs, function(...) redis.call('SADD', KEYS[4], ...) end)
    elseif code == 'se' then
      each_chunk(hs, function(...) redis.call('ZREM', KEYS[3], ...) end)
      each_chunk(hs, function(...) redis.call('SREM', KEYS[4], ...) end)
    elseif code == 'sc' then
      redis.call('UNLINK', KEYS[3], KEYS[4])
    end
    last = seq
  end
end
redis.call('HSET', KEYS[2], 'e', epoch, 's', last)
redis.call('PEXPIRE', KEYS[2], ARGV[6])
redis.call('PEXPIRE', KEYS[1], ARGV[6])
local function forget(members)
  each_chunk(members, function(...) redis.call('ZREM', KEYS[3], ...) end)
  each_chunk(members, function(...) redis.call('SREM', KEYS[4], ...) end)
end
forget(redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', now, 'LIMIT', 0, 4000))  -- bounded purge
local excess = redis.call('ZCARD', KEYS[3]) - tonumber(ARGV[5])
if excess > 0 then  -- cap: the soonest-expiring entries go first
  local popped, members = redis.call('ZPOPMIN', KEYS[3], excess), {}
  for j = 1, #popped, 2 do members[#members + 1] = popped[j] end
  each_chunk(members, function(...) redis.call('SREM', KEYS[4], ...) end)
end
excess = redis.call('SCARD', KEYS[1]) - tonumber(ARGV[4])
if excess > 0 then redis.call('SPOP', KEYS[1], excess) end
return {status, last}
"""
)

# KEYS: staged (a key of its own per snapshot).  ARGV: ttl_ms, hashes blob.
# A snapshot is uploaded into `staged` by many small calls of this script, so that Redis
# serves everyone else between them (one script adding 1M members stalled it ~1.5 s);
# the TTL removes what a replica that died mid-upload left behind.
STAGE_SCRIPT = (
    _HELPERS
    + """
each_chunk(split(ARGV[2]), function(...) redis.call('SADD', KEYS[1], ...) end)
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return 1
"""
)

# KEYS: mem, cur, alive, staged (absent when the snapshot is empty).
# ARGV: epoch, last_seq, idle_ttl_ms.
# Makes the staged set the worker's memory tier unless Redis already holds a newer state
# of the same epoch. O(1) whatever the sizes: RENAME, and UNLINK frees the old set in
# Redis's background thread.
SNAPSHOT_SCRIPT = """
local cur = redis.call('HMGET', KEYS[2], 'e', 's')
local last = tonumber(ARGV[2])
if cur[1] == ARGV[1] and last >= 0 and tonumber(cur[2]) >= last then
  redis.call('UNLINK', KEYS[4])
  return 0
end
redis.call('UNLINK', KEYS[1])
if redis.call('EXISTS', KEYS[4]) == 1 then redis.call('RENAME', KEYS[4], KEYS[1]) end
redis.call('HSET', KEYS[2], 'e', ARGV[1], 's', last)
redis.call('PEXPIRE', KEYS[2], ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
redis.call('SET', KEYS[3], '1')
return 1
"""

# KEYS: store (zset), store_set, then one mem key per candidate worker, grouped by format.
# ARGV: now, n_groups, then per kv_format group: hashes blob, number of its workers.
# Returns per group: leading store blocks, then each worker's leading memory blocks.
# Per set: SISMEMBER probes (galloping 1, 4, 16, ... then bisecting) find a hit b followed
# by a miss, so the leading count is at most b; one SMISMEMBER pass over blocks 1..b then
# gives it exactly (the first miss, if the set is not prefix-closed). Cost: ~2 log2(n)
# probes plus the leading count itself in membership tests, never more (a miss costs one
# probe). Store expiry is checked by score only when some entry outlived its TTL without
# being purged yet (apply purges continuously): scores cost ~3x more per block.
LOOKUP_SCRIPT = """
local now = tonumber(ARGV[1])
local out = {}
local a, k = 3, 3
local stale = #redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, 1) > 0
for g = 1, tonumber(ARGV[2]) do
  local blob, nw = ARGV[a], tonumber(ARGV[a + 1])
  a = a + 2
  local n = #blob / 8
  local hs = {}
  local function hash(i)
    local h = hs[i]
    if h == nil then h = string.sub(blob, i * 8 - 7, i * 8); hs[i] = h end
    return h
  end
  local function has(key, i) return redis.call('SISMEMBER', key, hash(i)) == 1 end
  local function leading(key)
    if n == 0 or not has(key, 1) then return 0 end
    local lo, hi = 1, n + 1  -- block lo is in the set, block hi is not (n + 1: past the end)
    while true do
      local p = math.min(lo * 4, hi - 1)
      if p <= lo then break end
      if has(key, p) then lo = p else hi = p; break end
    end
    while hi - lo > 1 do
      local mid = math.floor((lo + hi) / 2)
      if has(key, mid) then lo = mid else hi = mid end
    end
    for pos = 1, lo, 512 do
      local last = math.min(lo, pos + 511)
      for i = pos, last do hash(i) end
      local m = redis.call('SMISMEMBER', key, unpack(hs, pos, last))
      for j = 1, #m do
        if m[j] ~= 1 then return pos + j - 2 end
      end
    end
    return lo
  end
  local function unexpired(c)  -- leading blocks whose store entry has not expired
    for pos = 1, c, 512 do
      local sc = redis.call('ZMSCORE', KEYS[1], unpack(hs, pos, math.min(c, pos + 511)))
      for j = 1, #sc do
        if not (sc[j] and tonumber(sc[j]) > now) then return pos + j - 2 end
      end
    end
    return c
  end
  local c = leading(KEYS[2])
  if stale and c > 0 then c = unexpired(c) end
  out[#out + 1] = c
  for w = 1, nw do
    out[#out + 1] = leading(KEYS[k])
    k = k + 1
  end
end
return out
"""


class Script:
    def __init__(self, source: str) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()

    async def run(
        self, client: aioredis.Redis, keys: Sequence[str], args: Sequence[Any], *, read_only: bool = False
    ) -> Any:
        try:
            if read_only:
                return await client.evalsha_ro(self.sha, len(keys), *keys, *args)
            return await client.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:
            if read_only:
                return await client.eval_ro(self.source, len(keys), *keys, *args)
            return await client.eval(self.source, len(keys), *keys, *args)
