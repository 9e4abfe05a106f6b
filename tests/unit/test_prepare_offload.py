"""Where the gateway prepares large bodies (recipe_bridge/prepare.py `RequestPreparer.prepare_async`).

Default: one dedicated thread, preparations one at a time, GIL switch interval <= 0.5 ms
(several preparation threads at once starved the event loop that relays every other
stream's tokens; bench/relay_under_prep.py measures it). "pool" is asyncio's default
executor, "loop" prepares text inline. The relay latency itself is measured by the bench,
not asserted here (timing on a shared machine).
"""

from __future__ import annotations

import asyncio
import sys
import threading
from collections.abc import Iterator

import orjson
import pytest

from deepinfer_gateway.kvcache.hashing import pack_tokens
from deepinfer_gateway.kvcache.packed_ids import _UNPACK_CHUNK, unpacked
from deepinfer_gateway.recipe_bridge.encoder import PromptEncoder
from deepinfer_gateway.recipe_bridge.prepare import (
    OFFLOAD_BODY_BYTES,
    OFFLOAD_ENV,
    ApiProtocol,
    RequestPreparer,
    parse_offload,
)
from deepinfer_gateway.recipe_bridge.tokenizer import load_tokenizer

MODEL = "DeepSeek-V4.1-Flash"


@pytest.fixture(scope="module")
def encoder() -> PromptEncoder:
    return PromptEncoder(load_tokenizer())


@pytest.fixture(autouse=True)
def _restore_switch_interval(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv(OFFLOAD_ENV, raising=False)
    saved = sys.getswitchinterval()
    yield
    sys.setswitchinterval(saved)


def _body(i: int, size: int) -> bytes:
    text = f"[{i}] " + "the gateway prepares this prompt " * (size // 33 + 1)
    return orjson.dumps({"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": text}]})


class _Spy:
    """Wraps `prepare`: which thread ran each call, and the most that ran at once."""

    def __init__(self, preparer: RequestPreparer):
        self.inner = preparer.prepare
        self.threads: list[str] = []
        self.running = 0
        self.most = 0
        self.lock = threading.Lock()
        preparer.prepare = self  # type: ignore[method-assign]

    def __call__(self, protocol: ApiProtocol, body: bytes):
        with self.lock:
            self.running += 1
            self.most = max(self.most, self.running)
            self.threads.append(threading.current_thread().name)
        try:
            return self.inner(protocol, body)
        finally:
            with self.lock:
                self.running -= 1


async def _burst(preparer: RequestPreparer, bodies: list[bytes]) -> list[int]:
    prepared = await asyncio.gather(*(preparer.prepare_async(ApiProtocol.CHAT, b) for b in bodies))
    return [p.prompt_tokens for p in prepared]


def test_default_prepares_large_bodies_one_at_a_time_in_one_thread(encoder: PromptEncoder) -> None:
    sys.setswitchinterval(0.005)
    preparer = RequestPreparer(encoder)
    assert preparer.offload == "thread"
    assert sys.getswitchinterval() <= 0.0005 + 1e-9
    spy = _Spy(preparer)
    bodies = [_body(i, 2 * OFFLOAD_BODY_BYTES) for i in range(6)]
    tokens = asyncio.run(_burst(preparer, bodies))
    assert all(t > 10_000 for t in tokens)
    assert spy.most == 1  # a burst is prepared back to back, never several threads at once
    assert len(set(spy.threads)) == 1 and spy.threads[0].startswith("prepare")
    assert tokens == [spy.inner(ApiProtocol.CHAT, b).prompt_tokens for b in bodies]  # same result as inline


def test_small_bodies_stay_on_the_loop(encoder: PromptEncoder) -> None:
    preparer = RequestPreparer(encoder)
    spy = _Spy(preparer)
    asyncio.run(_burst(preparer, [_body(1, 1000)]))
    assert spy.threads == [threading.main_thread().name]


def test_modes_from_the_environment(encoder: PromptEncoder, monkeypatch: pytest.MonkeyPatch) -> None:
    big = [_body(i, 2 * OFFLOAD_BODY_BYTES) for i in range(3)]
    monkeypatch.setenv(OFFLOAD_ENV, "loop")
    preparer = RequestPreparer(encoder)
    spy = _Spy(preparer)
    asyncio.run(_burst(preparer, big))
    assert set(spy.threads) == {threading.main_thread().name}

    monkeypatch.setenv(OFFLOAD_ENV, "pool@5")
    preparer = RequestPreparer(encoder)
    assert preparer.offload == "pool" and sys.getswitchinterval() == pytest.approx(0.005)
    spy = _Spy(preparer)
    asyncio.run(_burst(preparer, big))
    assert threading.main_thread().name not in spy.threads and not any(t.startswith("prepare") for t in spy.threads)


def test_images_go_to_the_default_executor(encoder: PromptEncoder) -> None:
    preparer = RequestPreparer(encoder)
    spy = _Spy(preparer)
    body = orjson.dumps({"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "no image here, only the word"}]}]}).replace(b"no image", b"image")
    asyncio.run(_burst(preparer, [body]))
    assert spy.threads and not spy.threads[0].startswith("prepare") and spy.threads[0] != threading.main_thread().name


def test_offload_spec() -> None:
    assert parse_offload("thread") == ("thread", None)
    assert parse_offload("thread@0.25") == ("thread", 0.00025)
    with pytest.raises(ValueError):
        parse_offload("threads")
    with pytest.raises(ValueError):
        RequestPreparer(PromptEncoder.__new__(PromptEncoder), offload="process")


def test_unpacking_in_chunks_is_exact() -> None:
    for n in (0, 5, _UNPACK_CHUNK, _UNPACK_CHUNK + 1, 3 * _UNPACK_CHUNK + 17):
        raw = [(i * 7919) % 300_000 for i in range(n)] + [2**32 - 1] * (n > 0)
        out = unpacked(pack_tokens(raw))
        assert out == raw and all(type(a) is int for a in out)


def test_requests_with_images_are_prepared_a_bounded_number_at_a_time(encoder: PromptEncoder) -> None:
    """Decoding holds memory by pixels: at most `images.max_concurrent` image requests at once."""
    from deepinfer_gateway.config import ImageSettings
    from deepinfer_gateway.recipe_bridge.prepare import BridgeConfig

    preparer = RequestPreparer(encoder, BridgeConfig(images=ImageSettings(max_concurrent=2)))
    spy = _Spy(preparer)
    inner = spy.inner

    def slow(protocol: ApiProtocol, body: bytes):  # long enough for the burst to overlap
        threading.Event().wait(0.05)
        return inner(protocol, body)

    spy.inner = slow
    body = orjson.dumps({"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "an image"}]})
    asyncio.run(_burst(preparer, [body] * 8))
    assert len(spy.threads) == 8 and spy.most == 2
