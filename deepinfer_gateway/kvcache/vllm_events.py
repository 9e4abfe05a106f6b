"""vLLM's own KV events -> the prefix index: `VllmKvSubscriber` receives one worker's event
batches over ZMQ, orders and resyncs them, and calls `index.apply` with what
`vllm_translate.VllmKvTranslator` makes of them.

vLLM (`--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", ...}'`)
publishes on a ZMQ PUB socket one multipart message per engine step that changed its prefix
cache: `[topic, seq (8-byte big-endian, from 0 per process), msgpack KVEventBatch]`, and keeps
the last `buffer_steps` messages for a ROUTER replay socket.

Ordering and resync: our events get gap-free seqs within an epoch the translator owns. A
fresh epoch, opened by a `cleared` event, drops the worker's memory tier in the index; it is
opened when we start listening, when vLLM sends `AllBlocksCleared`, when vLLM restarted (seq
went back with a batch we never saw, or the replay socket no longer holds what we saw), and
when a gap cannot be filled from the replay socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict

import msgspec
import zmq
import zmq.asyncio

from deepinfer_gateway.core.protocol import KV_BLOCK_TOKENS, KvEventBatch
from deepinfer_gateway.kvcache.types import PrefixIndex
from deepinfer_gateway.kvcache.vllm_translate import VllmEventBatch, VllmKvTranslator, decode_batch

log = logging.getLogger(__name__)

_REPLAY_END = -1
_SEEN_BATCHES = 4096  # (seq -> ts) remembered to tell a duplicate from a restarted publisher


class VllmKvSubscriber:
    """Feeds one vLLM worker's ZMQ KV events into a `PrefixIndex`.

    `endpoint`: vLLM's `endpoint` as a peer reaches it (vLLM binds `tcp://*:P`, ipc and inproc
    endpoints and connects to any other: then pass `bind=True` and the address vLLM connects
    to). `replay_endpoint`: vLLM's `replay_endpoint` (always bound by vLLM), or None: every gap
    then clears the worker's entries. `topic`: vLLM's `topic` (default "").

    Start-up and reconnects (ZMQ drops what a PUB sends before a SUB's connection is up, the
    slow-joiner problem) ask the replay socket for everything from seq 0, so blocks stored before
    we listened are learnt if vLLM still buffers them.
    """

    def __init__(
        self,
        index: PrefixIndex,
        worker_id: str,
        endpoint: str,
        replay_endpoint: str | None,
        salt: bytes,
        *,
        topic: str = "",
        bind: bool = False,
        block_tokens: int = KV_BLOCK_TOKENS,
        replay_timeout_s: float = 2.0,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        self.index = index
        self.worker_id = worker_id
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.bind = bind
        self.replay_timeout_s = replay_timeout_s
        self.translator = VllmKvTranslator(worker_id, salt, block_tokens)
        self._ctx = context or zmq.asyncio.Context.instance()
        self._next_seq: int | None = None  # vLLM seq expected next; None: nothing applied yet
        self._seen: OrderedDict[int, float] = OrderedDict()
        self._task: asyncio.Task[None] | None = None
        self._sub: zmq.asyncio.Socket | None = None
        self.stats = {"batches": 0, "gaps": 0, "replayed": 0, "resyncs": 0, "restarts": 0, "undecodable": 0}

    async def start(self) -> None:
        """Connect, clear the worker's entries (a new epoch), catch up from the replay buffer,
        then follow the live feed in a task."""
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        sub.setsockopt(zmq.LINGER, 0)
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_ACCEPTED)
        if self.bind:
            sub.bind(self.endpoint)
        else:
            sub.connect(self.endpoint)
        self._sub = sub
        await self._apply(self.translator.flush())
        self._task = asyncio.get_running_loop().create_task(self._run(sub, monitor), name=f"vllm-kv:{self.worker_id}")

    async def aclose(self, *, forget: bool = False) -> None:
        """Stop listening; with `forget`, also drop the worker from the index."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._sub is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._sub.disable_monitor()
            self._sub.close(linger=0)
            self._sub = None
        if forget:
            await self.index.remove_worker(self.worker_id)

    # --- the loop ----------------------------------------------------------------------

    async def _run(self, sub: zmq.asyncio.Socket, monitor: zmq.asyncio.Socket) -> None:
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        try:
            while True:
                ready = dict(await poller.poll())
                if monitor in ready:
                    await monitor.recv_multipart()
                    await self._catch_up(live_seq=None)  # (re)connected: vLLM may be a new process
                if sub in ready:
                    frames = await sub.recv_multipart()
                    if len(frames) != 3 or frames[0] != self.topic:
                        continue
                    await self._on_live(int.from_bytes(frames[1], "big"), frames[2])
        finally:
            monitor.close(linger=0)

    async def _on_live(self, seq: int, payload: bytes) -> None:
        batch = self._decode(payload)
        if batch is None:
            return
        expected = self._next_seq
        if expected is not None and seq < expected:
            if self._seen.get(seq) == batch.ts:
                return  # a duplicate of a replayed batch
            self.stats["restarts"] += 1  # seqs went back with a batch we never saw: a new vLLM process
            log.info("vllm kv events: %s restarted (seq %d after %d); clearing its entries",
                     self.worker_id, seq, expected)
            await self._resync()
            await self._catch_up(live_seq=seq)
        elif expected is None or seq > expected:
            if expected is not None:
                self.stats["gaps"] += 1
            await self._catch_up(live_seq=seq)
        if self._next_seq is not None and seq < self._next_seq:
            return  # the catch-up replayed this one
        if self._next_seq is not None and seq != self._next_seq:
            await self._resync()  # the replay could not bridge the gap
        await self._apply_vllm(seq, batch)

    async def _catch_up(self, live_seq: int | None) -> None:
        """Apply what the replay buffer holds after what we applied (and before `live_seq`).

        Reconnect check (`live_seq` None): if the buffer no longer holds a batch we applied
        (same seq and ts), vLLM restarted: clear and take the new process's batches."""
        start = 0 if self._next_seq is None or live_seq is None else self._next_seq
        replayed = await self._replay(start)
        if replayed is None:
            return
        if live_seq is None and self._next_seq is not None:
            if not self._same_publisher(replayed):
                self.stats["restarts"] += 1
                log.info("vllm kv events: %s is a new process (replay buffer differs); clearing its entries",
                         self.worker_id)
                await self._resync()
        for seq, payload in replayed:
            if live_seq is not None and seq >= live_seq:
                break
            if self._next_seq is not None and seq < self._next_seq:
                continue
            batch = self._decode(payload)
            if batch is None:
                continue
            if self._next_seq is not None and seq != self._next_seq:
                await self._resync()  # the buffer starts after what we need
            self.stats["replayed"] += 1
            await self._apply_vllm(seq, batch)

    def _same_publisher(self, replayed: list[tuple[int, bytes]]) -> bool:
        if not replayed:
            return self._next_seq == 0  # nothing published by the process we knew either
        for seq, payload in replayed:
            if seq in self._seen:
                batch = self._decode(payload)
                return batch is not None and self._seen[seq] == batch.ts
        # None of the buffer is a batch we saw: same process only if it continues where we stopped.
        return replayed[0][0] <= (self._next_seq or 0)

    async def _replay(self, start: int) -> list[tuple[int, bytes]] | None:
        """Buffered `(seq, payload)` from `start` on; None without a replay socket or an answer."""
        if self.replay_endpoint is None:
            return None
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay_endpoint)
        out: list[tuple[int, bytes]] = []
        try:
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                if not await dealer.poll(int(self.replay_timeout_s * 1000)):
                    log.warning("vllm kv events: %s's replay socket did not answer", self.worker_id)
                    return None
                frames = await dealer.recv_multipart()
                if len(frames) != 4:
                    continue
                seq = int.from_bytes(frames[2], "big", signed=True)
                if seq == _REPLAY_END:
                    return out
                if frames[1] == self.topic:
                    out.append((seq, frames[3]))
        finally:
            dealer.close(linger=0)

    async def _resync(self) -> None:
        """Clear the worker's entries now (a new epoch); the next batch applied starts afresh."""
        self.stats["resyncs"] += 1
        self.translator.new_epoch()
        self._next_seq = None
        self._seen.clear()
        fresh = self.translator.flush()
        assert fresh is not None  # a new epoch opens with its cleared event
        cursor = await self.index.apply(self.worker_id, fresh)
        if cursor != fresh.last_seq:
            log.error("vllm kv events: index refused %s's cleared event (cursor %d)", self.worker_id, cursor)

    def _decode(self, payload: bytes) -> VllmEventBatch | None:
        try:
            return decode_batch(payload)
        except msgspec.DecodeError as exc:
            self.stats["undecodable"] += 1
            if self.stats["undecodable"] == 1:
                log.warning("vllm kv events: %s sent a batch this decoder cannot read (%s)", self.worker_id, exc)
            return None

    async def _apply_vllm(self, seq: int, batch: VllmEventBatch) -> None:
        self._next_seq = seq + 1
        self._seen[seq] = batch.ts
        while len(self._seen) > _SEEN_BATCHES:
            self._seen.popitem(last=False)
        self.stats["batches"] += 1
        await self._apply(self.translator.translate(batch))

    async def _apply(self, batch: KvEventBatch | None) -> None:
        if batch is None:
            return
        cursor = await self.index.apply(self.worker_id, batch)
        if cursor != batch.last_seq:  # the index did not take it in order: start over, cleared
            log.warning("vllm kv events: index refused %s's batch (cursor %d); clearing", self.worker_id, cursor)
            await self._resync()

