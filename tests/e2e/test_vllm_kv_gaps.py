"""VllmKvSubscriber's ordering rules over real ZMQ sockets: a publisher in the test speaks vLLM's
framing (PUB `[topic, seq, batch]`, ROUTER replay answering `[topic, seq, batch]`... then the end
marker) and drops chosen seqs from the live feed. The real vLLM's encoding is covered by
tests/e2e/test_vllm_kv_events.py; this file makes the gaps vLLM will not make on demand."""

from __future__ import annotations

import asyncio
import random
import time

import msgspec
import zmq
import zmq.asyncio

from deepinfer_gateway.core.protocol import KV_BLOCK_TOKENS, KvEventKind
from deepinfer_gateway.kvcache.hashing import block_hashes, kv_salt
from deepinfer_gateway.kvcache.memory import InMemoryPrefixIndex
from deepinfer_gateway.kvcache.vllm_events import VllmKvSubscriber
from deepinfer_gateway.kvcache.vllm_translate import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    VllmEventBatch,
    VllmKvTranslator,
)
from harness.launch import free_port

SALT = kv_salt("m", "f")
B = KV_BLOCK_TOKENS


def tokens(blocks: int) -> list[int]:
    return [random.randrange(1, 100_000) for _ in range(blocks * B)]


def stored(vllm_hashes: list[int], toks: list[int], parent: int | None = None) -> BlockStored:
    return BlockStored(block_hashes=vllm_hashes, parent_block_hash=parent, token_ids=toks, block_size=B, medium="GPU")


def test_translator_recomputes_the_gateway_chain_across_events() -> None:
    t = VllmKvTranslator("w", SALT)
    prompt = tokens(3)
    first = t.translate(VllmEventBatch(ts=1.0, events=[stored([11, 12], prompt[: 2 * B])]))
    second = t.translate(VllmEventBatch(ts=2.0, events=[stored([13], prompt[2 * B :], parent=12)]))
    assert first is not None and second is not None
    assert [e.kind for e in first.events] == [KvEventKind.CLEARED, KvEventKind.STORED]  # a new epoch opens cleared
    assert first.events[1].block_hashes + second.events[0].block_hashes == block_hashes(prompt, SALT)
    assert [e.seq for e in first.events + second.events] == [1, 2, 3]

    orphan = t.translate(VllmEventBatch(ts=3.0, events=[stored([99], tokens(1), parent=98)]))
    assert orphan is None and t.skipped_blocks == 1  # parent never seen: not indexed

    removed = t.translate(VllmEventBatch(ts=4.0, events=[BlockRemoved(block_hashes=[13, 77], medium="GPU")]))
    assert removed is not None and removed.events[0].block_hashes == block_hashes(prompt, SALT)[2:]
    cleared = t.translate(VllmEventBatch(ts=5.0, events=[AllBlocksCleared()]))
    assert cleared is not None and cleared.events[0].kind is KvEventKind.CLEARED and t.known_blocks == 0


class Publisher:
    """vLLM's ZmqEventPublisher's wire behaviour, with a switch to drop live messages."""

    def __init__(self, topic: bytes = b"kv") -> None:
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.router = self.ctx.socket(zmq.ROUTER)
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.replay_endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.pub.bind(self.endpoint)
        self.router.bind(self.replay_endpoint)
        self.topic = topic
        self.buffer: list[tuple[int, bytes]] = []
        self.seq = 0
        self.encoder = msgspec.msgpack.Encoder()

    def publish(self, *events: object, live: bool = True, buffered: bool = True) -> None:
        payload = self.encoder.encode(VllmEventBatch(ts=time.time(), events=list(events)))
        seq, self.seq = self.seq, self.seq + 1
        if live:
            self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
        if buffered:
            self.buffer.append((seq, payload))

    def serve_replays(self) -> None:
        while self.router.poll(0):
            client, _, start = self.router.recv_multipart()
            for seq, payload in self.buffer:
                if seq >= int.from_bytes(start, "big"):
                    self.router.send_multipart([client, b"", self.topic, seq.to_bytes(8, "big"), payload])
            self.router.send_multipart([client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])

    def close(self) -> None:
        self.pub.close(linger=0)
        self.router.close(linger=0)
        self.ctx.term()


async def settle(pub: Publisher, index: InMemoryPrefixIndex, prompt: list[int], want: int) -> int:
    got = -1
    for _ in range(200):
        pub.serve_replays()
        got = index.lookup_now({"f": block_hashes(prompt, SALT)}, {"w": "f"}).memory["w"]
        if got == want:
            return got
        await asyncio.sleep(0.02)
    return got


async def test_gap_is_filled_from_replay_then_cleared_when_replay_cannot() -> None:
    pub = Publisher()
    index = InMemoryPrefixIndex()
    sub = VllmKvSubscriber(index, "w", pub.endpoint, pub.replay_endpoint, SALT, topic="kv", replay_timeout_s=0.5)
    await sub.start()
    try:
        a = tokens(3)
        for _ in range(50):  # past the slow joiner: the connect-time replay has run
            pub.serve_replays()
            await asyncio.sleep(0.02)
        pub.publish(stored([1], a[:B]))
        pub.publish(stored([2], a[B : 2 * B], parent=1), live=False)  # lost on the wire, kept for replay
        pub.publish(stored([3], a[2 * B :], parent=2))
        assert await settle(pub, index, a, 3) == 3
        assert sub.stats["gaps"] == 1 and sub.stats["replayed"] >= 1 and sub.stats["resyncs"] == 0

        b = tokens(1)
        pub.publish(BlockRemoved(block_hashes=[3], medium="GPU"), live=False, buffered=False)  # gone for good
        pub.publish(stored([4], b))
        assert await settle(pub, index, b, 1) == 1
        assert await settle(pub, index, a, 0) == 0  # the worker's earlier entries were dropped: a new epoch
        assert sub.stats["resyncs"] == 1
    finally:
        await sub.aclose()
        pub.close()
