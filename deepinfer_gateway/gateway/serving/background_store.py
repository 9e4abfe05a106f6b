"""A background response's run state beside its stored record (response_store.py).

A background response (`background: true`) is a stored response whose record is rewritten as
it runs (queued, in_progress, then its final status), with a run state: its status, the time
its runner last reported (`beat`: a runner whose gateway died stops reporting, and a reader
then marks it failed), and, when it was asked for a stream, its SSE events in order (what a
resuming reader replays). Every change is a compare-and-set on the status: once a response is
terminal (completed, incomplete, failed, cancelled) nothing changes it, so a cancel and the
runner's last write cannot both win.

Redis: under the stored responses' hash tag, so its bytes count in the owner's and the total
budget and the record's deletion (DELETE, expiry) deletes it too (response_store._PRELUDE's
`drop`): `{dgw:resp}:bg:<owner>:<id>` (hash: state, beat, n: the events held) and
`{dgw:resp}:ev:<owner>:<id>` (hash: sequence number -> event). Memory: the same, in this
process, the events bounded by the record's `max_bytes` (not counted in the owner's bytes).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

from deepinfer_gateway.gateway.serving.response_store import (
    _PRELUDE,
    TAG,
    MemoryResponseStore,
    RedisResponseStore,
    StoredResponse,
    StoreExhausted,
    StoreFull,
    _check_size,
    _refusal,
    owner_hash,
)

QUEUED, IN_PROGRESS = "queued", "in_progress"
RUNNING = (QUEUED, IN_PROGRESS)
GONE = "gone"  # deleted (DELETE, expiry) while it ran
FULL = "full"  # its record and events would pass a byte bound


@dataclass(frozen=True, slots=True)
class RunState:
    state: str
    beat: float  # time.time() of the runner's last report
    events: int  # how many are held (the next one's sequence number)


class BackgroundStore(Protocol):
    async def start(self, owner: str, response_id: str, stored: StoredResponse) -> None:
        """Keep the queued record (the stored responses' bounds: StoreFull, StoreExhausted)."""

    async def advance(self, owner: str, response_id: str, *, state: str = "", stored: StoredResponse | None = None,
                      events: tuple[bytes, ...] = ()) -> str:
        """While it runs: append `events`, replace the record, set `state` (each optional), note
        the beat. Returns its status after (the terminal one that was there already, when it
        was: nothing changed then), GONE or FULL."""

    async def run_state(self, owner: str, response_id: str) -> RunState | None: ...

    async def record(self, owner: str, response_id: str) -> StoredResponse | None: ...

    async def events(self, owner: str, response_id: str, first: int, end: int) -> list[bytes]:
        """Its events `first` .. `end` - 1."""


# ARGV[3..5] as response_store's; ARGV[6] id, ARGV[7] record, ARGV[8] its expiry.
_START = _PRELUDE + """
purge()
local refused = keep(ARGV[6], ARGV[7], tonumber(ARGV[8]), tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5]))
if refused ~= 0 then return refused end
redis.call('HSET', tag .. ':bg:' .. owner .. ':' .. ARGV[6], 'state', 'queued', 'beat', ARGV[1], 'n', 0)
return 0
"""

# ARGV[3] max_bytes (the record and its events), ARGV[4..5] as response_store's; ARGV[6] id,
# ARGV[7] the new state or '', ARGV[8] the new record or '', ARGV[9..] events.
_ADVANCE = _PRELUDE + """
local id, state, data = ARGV[6], ARGV[7], ARGV[8]
local member = owner .. ':' .. id
local run, record = tag .. ':bg:' .. member, tag .. ':r:' .. member
local current = redis.call('HGET', run, 'state')
if not current or redis.call('EXISTS', record) == 0 then return 'gone' end
if current ~= 'queued' and current ~= 'in_progress' then return current end
local delta = 0
for i = 9, #ARGV do delta = delta + #ARGV[i] end
if data ~= '' then delta = delta + #data - #redis.call('GET', record) end
if delta > 0 then
  if tonumber(redis.call('HGET', size_key, member) or '0') + delta > tonumber(ARGV[3]) then return 'full' end
  if verdict(delta, 0, tonumber(ARGV[4]), tonumber(ARGV[5])) ~= 0 then return 'full' end
end
local n = tonumber(redis.call('HGET', run, 'n'))
for i = 9, #ARGV do
  redis.call('HSET', tag .. ':ev:' .. member, n, ARGV[i])
  n = n + 1
end
if data ~= '' then redis.call('SET', record, data) end
if state == '' then state = current end
redis.call('HSET', run, 'state', state, 'beat', ARGV[1], 'n', n)
redis.call('HINCRBY', size_key, member, delta)
redis.call('HINCRBY', bytes_key, owner, delta)
redis.call('HINCRBY', bytes_key, '*', delta)
return state
"""


class RedisBackgroundStore:
    def __init__(self, responses: RedisResponseStore):
        self.responses = responses
        self.quota = responses.quota
        self._start = responses.redis.register_script(_START)
        self._advance = responses.redis.register_script(_ADVANCE)

    def _member(self, owner: str, response_id: str) -> str:
        return f"{owner_hash(owner)}:{response_id}"

    async def start(self, owner: str, response_id: str, stored: StoredResponse) -> None:
        data = stored.dumps()
        _check_size(data, self.quota)
        digest, keys = self.responses._keys(owner)
        now = time.time()
        q = self.quota
        verdict = await self._start(keys=keys, args=[now, digest, q.max_per_key, q.max_bytes_per_key,
                                                     q.max_total_bytes, response_id, data, now + q.ttl_s])
        refused = _refusal(int(verdict), q)
        if refused is not None:
            raise refused

    async def advance(self, owner: str, response_id: str, *, state: str = "", stored: StoredResponse | None = None,
                      events: tuple[bytes, ...] = ()) -> str:
        digest, keys = self.responses._keys(owner)
        q = self.quota
        reply = await self._advance(keys=keys, args=[time.time(), digest, q.max_bytes, q.max_bytes_per_key,
                                                     q.max_total_bytes, response_id, state,
                                                     stored.dumps() if stored is not None else b"", *events])
        return reply.decode() if isinstance(reply, bytes) else str(reply)

    async def record(self, owner: str, response_id: str) -> StoredResponse | None:
        return await self.responses.get(owner, response_id)

    async def run_state(self, owner: str, response_id: str) -> RunState | None:
        state, beat, events = await self.responses.redis.hmget(f"{TAG}:bg:{self._member(owner, response_id)}",
                                                               ["state", "beat", "n"])
        if state is None or beat is None or events is None:
            return None
        return RunState(state.decode() if isinstance(state, bytes) else state, float(beat), int(events))

    async def events(self, owner: str, response_id: str, first: int, end: int) -> list[bytes]:
        if end <= first:
            return []
        found = await self.responses.redis.hmget(f"{TAG}:ev:{self._member(owner, response_id)}",
                                                 [str(n) for n in range(first, end)])
        return [event if isinstance(event, bytes) else event.encode() for event in found if event is not None]


@dataclass
class _Run:
    state: str
    beat: float
    record: int  # its record's bytes
    events: list[bytes] = field(default_factory=list)
    size: int = 0  # its events' bytes


class MemoryBackgroundStore:
    def __init__(self, responses: MemoryResponseStore):
        self.responses = responses
        self.quota = responses.quota
        self._runs: dict[tuple[str, str], _Run] = {}

    async def start(self, owner: str, response_id: str, stored: StoredResponse) -> None:
        for key in [k for k in self._runs if k[0] == owner]:  # forget the runs whose records are gone
            await self._run(*key)
        await self.responses.check_room(owner, len(stored.dumps()))
        await self.responses.put(owner, response_id, stored)
        self._runs[(owner, response_id)] = _Run(QUEUED, time.time(), len(stored.dumps()))

    async def _run(self, owner: str, response_id: str) -> _Run | None:
        run = self._runs.get((owner, response_id))
        if run is not None and await self.responses.get(owner, response_id) is None:
            del self._runs[(owner, response_id)]  # its record was deleted or expired
            return None
        return run

    async def advance(self, owner: str, response_id: str, *, state: str = "", stored: StoredResponse | None = None,
                      events: tuple[bytes, ...] = ()) -> str:
        run = await self._run(owner, response_id)
        if run is None:
            return GONE
        if run.state not in RUNNING:
            return run.state
        added = sum(len(event) for event in events)
        record = len(stored.dumps()) if stored is not None else run.record
        if record + run.size + added > self.quota.max_bytes:
            return FULL
        if stored is not None:
            old = await self.responses.get(owner, response_id)
            try:
                await self.responses.put(owner, response_id, stored)
            except (StoreFull, StoreExhausted):  # past the owner's or all owners' bytes: the old one back
                if old is not None:
                    await self.responses.put(owner, response_id, old)
                return FULL
            run.record = record
        run.events.extend(events)
        run.size += added
        run.state = state or run.state
        run.beat = time.time()
        return run.state

    async def record(self, owner: str, response_id: str) -> StoredResponse | None:
        return await self.responses.get(owner, response_id)

    async def run_state(self, owner: str, response_id: str) -> RunState | None:
        run = await self._run(owner, response_id)
        return None if run is None else RunState(run.state, run.beat, len(run.events))

    async def events(self, owner: str, response_id: str, first: int, end: int) -> list[bytes]:
        run = await self._run(owner, response_id)
        return [] if run is None else run.events[first:end]
