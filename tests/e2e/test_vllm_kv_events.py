"""vLLM's own KV events, from a real vLLM-CPU server, reach the prefix index (memory and Redis
backends) under the gateway's hashes, directly and through a gateway on Redis; a restarted vLLM
is resynced (index cleared for it, the gateway sees its new epoch and serves on it)."""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import httpx
import openai
import pytest

from deepinfer_gateway.config import RedisSettings
from deepinfer_gateway.core.protocol import KV_BLOCK_TOKENS
from deepinfer_gateway.gateway.upstream.vllm import vllm_kv_format
from deepinfer_gateway.kvcache.factory import create_prefix_index
from deepinfer_gateway.kvcache.hashing import block_hashes, kv_salt
from deepinfer_gateway.kvcache.types import PrefixIndex
from deepinfer_gateway.kvcache.vllm_events import VllmKvSubscriber
from harness.launch import Gateway
from tests.e2e.test_vllm_gateway import ADMIN, ADMIN_KEY, admin_key_toml, vllm_worker_toml
from tests.vllm_server import KV_TOPIC, MODEL_NAME, VllmServer

FORMAT = "cpu-bf16"
SALT = kv_salt(MODEL_NAME, FORMAT)
WORKER = "vllm-0"


def unique_prompt(blocks: int, tail: int = 17) -> list[int]:
    rng = random.Random()
    return [rng.randrange(1000, 120_000) for _ in range(blocks * KV_BLOCK_TOKENS + tail)]


async def cached_blocks(index: PrefixIndex, prompt: list[int]) -> int:
    overlap = await index.lookup({FORMAT: block_hashes(prompt, SALT)}, {WORKER: FORMAT})
    return overlap.memory[WORKER]


async def eventually(check: Callable[[], Awaitable[bool]], timeout_s: float = 15.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await check():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.05)


async def complete(server: VllmServer, prompt: list[int]) -> int:
    """Run one completion; return vLLM's cached prompt tokens."""
    async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
        reply = await client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=1)
    assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
    return reply.usage.prompt_tokens_details.cached_tokens or 0


@pytest.fixture(params=["memory", "redis"])
async def index(request: pytest.FixtureRequest) -> AsyncIterator[PrefixIndex]:
    url = None if request.param == "memory" else request.getfixturevalue("redis_url")
    idx = create_prefix_index(RedisSettings(url=url), namespace=f"vllm-test:{uuid.uuid4().hex[:8]}")
    yield idx
    await idx.aclose()


def subscriber(index: PrefixIndex, server: VllmServer) -> VllmKvSubscriber:
    return VllmKvSubscriber(index, WORKER, server.kv_endpoint, server.kv_replay_endpoint, SALT, topic=KV_TOPIC)


async def test_stored_blocks_appear_under_gateway_hashes(vllm_server: VllmServer, index: PrefixIndex) -> None:
    sub = subscriber(index, vllm_server)
    await sub.start()
    try:
        prompt = unique_prompt(3)
        assert await complete(vllm_server, prompt) == 0
        await eventually(lambda: _equals(cached_blocks(index, prompt), 3))
        # the same first two blocks, then a different third: the index says two, as vLLM does
        sibling = prompt[: 2 * KV_BLOCK_TOKENS] + unique_prompt(1)
        assert await cached_blocks(index, sibling) == 2
        assert await complete(vllm_server, sibling) == 2 * KV_BLOCK_TOKENS
        await eventually(lambda: _equals(cached_blocks(index, sibling), 3))
        assert await cached_blocks(index, unique_prompt(2)) == 0
        assert sub.stats["undecodable"] == 0 and sub.translator.skipped_blocks == 0
    finally:
        await sub.aclose()


async def test_blocks_stored_before_subscribing_come_from_replay(vllm_server: VllmServer, index: PrefixIndex) -> None:
    prompt = unique_prompt(2)
    await complete(vllm_server, prompt)
    sub = subscriber(index, vllm_server)
    await sub.start()
    try:
        await eventually(lambda: _equals(cached_blocks(index, prompt), 2))
        assert sub.stats["replayed"] >= 1
    finally:
        await sub.aclose()


@pytest.mark.timeout(420)  # a vLLM start-up inside the test: ~2 min on a busy 2-core machine, bounded at 300 s
async def test_restarted_vllm_is_resynced(vllm_server: VllmServer, redis_url: str, tmp_path: Path) -> None:
    """One restart (the costly part: a new vLLM process) checked on both backends at once, and
    behind a gateway whose Redis index its KV events feed (under the gateway's own salt)."""
    shared = create_prefix_index(RedisSettings(url=redis_url), namespace=f"vllm-test:{uuid.uuid4().hex[:8]}")
    indexes = [create_prefix_index(None), shared]
    subs = [subscriber(idx, vllm_server) for idx in indexes]
    for sub in subs:
        await sub.start()
    gateway_index = create_prefix_index(RedisSettings(url=redis_url))  # the namespace the gateway below writes
    toml = f'redis.url = "{redis_url}"\n' + admin_key_toml() + vllm_worker_toml(vllm_server, worker_id=WORKER)
    gw = Gateway(tmp_path, [], extra_toml=toml)
    try:
        await asyncio.to_thread(gw.wait_ready, 1, 30)
        epoch = await asyncio.to_thread(worker_epoch, gw)
        before = unique_prompt(2)
        await complete(vllm_server, before)
        for idx in indexes:
            await eventually(lambda idx=idx: _equals(cached_blocks(idx, before), 2))  # type: ignore[misc]
        await eventually(lambda: _equals(gateway_blocks(gateway_index, before), 2))

        await asyncio.to_thread(vllm_server.restart)
        # No request yet: the reconnect alone shows a new process (its replay buffer is not the one we knew).
        for idx in indexes:
            await eventually(lambda idx=idx: _equals(cached_blocks(idx, before), 0))  # type: ignore[misc]
        await eventually(lambda: _equals(gateway_blocks(gateway_index, before), 0))
        assert all(sub.stats["restarts"] >= 1 for sub in subs)

        after = unique_prompt(3)
        assert await complete(vllm_server, after) == 0
        for idx in indexes:
            await eventually(lambda idx=idx: _equals(cached_blocks(idx, after), 3))  # type: ignore[misc]
            assert await cached_blocks(idx, before) == 0
        await eventually(lambda: _equals(gateway_blocks(gateway_index, after), 3))
        # the gateway saw the new process (its epoch) and serves on it
        await eventually(lambda: _is_new(asyncio.to_thread(worker_epoch, gw), epoch))
        async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=ADMIN_KEY, max_retries=0, timeout=60) as client:
            raw = await client.chat.completions.with_raw_response.create(
                model="DeepSeek-V4.1-Flash", max_tokens=2, messages=[{"role": "user", "content": "after restart"}])
        assert raw.headers["x-dgw-worker"] == WORKER and raw.parse().usage is not None
    finally:
        gw.stop()
        for sub in subs:
            await sub.aclose()
        for idx in [*indexes, gateway_index]:
            await idx.aclose()


async def gateway_blocks(index: PrefixIndex, prompt: list[int]) -> int:
    """Blocks of `prompt` the gateway's index holds for the vLLM worker, under the gateway's salt."""
    fmt = vllm_kv_format(MODEL_NAME, KV_BLOCK_TOKENS)
    overlap = await index.lookup({fmt: block_hashes(prompt, kv_salt(MODEL_NAME, fmt))}, {WORKER: fmt})
    return overlap.memory[WORKER]


def worker_epoch(gw: Gateway) -> str:
    workers = httpx.get(gw.url + "/admin/workers", headers=ADMIN, timeout=10).json()["workers"]
    load = next(w for w in workers if w["id"] == WORKER)["load"]
    return str(load["epoch"]) if load else ""


async def _is_new(value: Awaitable[str], old: str) -> bool:
    return await value not in ("", old)


async def _equals(value: Awaitable[int], expected: int) -> bool:
    return await value == expected
