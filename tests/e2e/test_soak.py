"""Soak: many concurrent streaming clients through a demo-like cluster; every token the worker
emitted reaches its client exactly once, in order.

The sim is deterministic per prompt, so each prompt's transcript is taken from a worker's
protocol endpoint directly (the same token ids and sampling the gateway sends, prepared by
the same recipe_bridge code) and decoded; every streamed answer through the gateway must
equal it character for character, with `usage.completion_tokens` equal to the transcript's
length.

Scale (2 shared cores by default): DGW_SOAK_STREAMS (200) concurrent clients for
DGW_SOAK_SECONDS (10); DGW_SOAK_FULL=1: 1,000 clients for 60 s.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from deepinfer_gateway.core import protocol as wp
from deepinfer_gateway.recipe_bridge.detokenizer import token_bytes
from deepinfer_gateway.recipe_bridge.encoder import PromptEncoder
from deepinfer_gateway.recipe_bridge.prepare import ApiProtocol, RequestPreparer
from deepinfer_gateway.recipe_bridge.tokenizer import load_tokenizer
from harness.launch import Gateway, SimCluster
from tests.fault_doubles import scrape, total

MODEL = "DeepSeek-V4.1-Flash"
FULL = os.environ.get("DGW_SOAK_FULL") == "1"
STREAMS = int(os.environ.get("DGW_SOAK_STREAMS", "1000" if FULL else "200"))
SECONDS = float(os.environ.get("DGW_SOAK_SECONDS", "60" if FULL else "10"))
PROMPTS = 32


def request_body(i: int) -> dict[str, object]:
    return {"model": MODEL, "max_tokens": 40 + (i * 7) % 60, "ignore_eos": i % 2 == 0,
            "thinking": {"type": "disabled"},
            "messages": [{"role": "user", "content": f"Soak prompt {i}: tell me about topic {i * 13}."}]}


async def transcripts(worker_url: str) -> dict[int, tuple[str, int]]:
    """prompt index -> (decoded text, token count), straight from a worker's protocol endpoint."""
    bundle = load_tokenizer()
    preparer = RequestPreparer(PromptEncoder(bundle))
    detok = token_bytes(bundle.json_text)
    out = {}
    async with aiohttp.ClientSession() as session:
        for i in range(PROMPTS):
            prepared = preparer.prepare(ApiProtocol.CHAT, json.dumps(request_body(i)).encode())
            body = {"request_id": f"transcript-{i}", "token_ids": list(prepared.token_ids),
                    "sampling": prepared.sampling.model_dump(by_alias=True, exclude_defaults=True)}
            ids: list[int] = []
            async with session.post(worker_url + wp.GENERATE_PATH, json=body) as r:
                async for line in r.content:
                    event = json.loads(line)
                    if event["event"] == "tokens":
                        ids += event["token_ids"]
                    elif event["event"] == "finish":
                        assert event["reason"] in ("stop", "length"), event
            out[i] = (detok.decode(ids), len(ids))
    return out


@pytest.fixture
def soak_gateway(tmp_path: Path) -> Iterator[tuple[SimCluster, Gateway]]:
    cluster = SimCluster("unified:sm100,unified:sm100,unified:ascend950", time_scale=1.0)
    roles = [s.split(":") for s in cluster.specs]
    gw = Gateway(tmp_path, [(u, r, h) for u, (r, h) in zip(cluster.urls, roles, strict=True)])
    gw.wait_ready(3)
    yield cluster, gw
    gw.stop()
    cluster.stop()


@pytest.mark.timeout(SECONDS * 3 + 120)
async def test_soak_every_token_exactly_once_in_order(soak_gateway: tuple[SimCluster, Gateway]) -> None:
    cluster, gw = soak_gateway
    expected = await transcripts(cluster.urls[0])
    stop_at = time.monotonic() + SECONDS
    results = {"ok": 0, "mismatch": 0, "errors": 0, "tokens": 0}
    mismatches: list[tuple[int, str, str]] = []

    async def client(session: aiohttp.ClientSession, c: int) -> None:
        n = c
        while time.monotonic() < stop_at:
            i = n % PROMPTS
            n += 7
            text, usage, done = "", None, False
            async with session.post(gw.url + "/v1/chat/completions",
                                    json={**request_body(i), "stream": True,
                                          "stream_options": {"include_usage": True}}) as r:
                if r.status != 200:
                    results["errors"] += 1
                    continue
                async for raw in r.content:
                    if not raw.startswith(b"data: "):
                        continue
                    data = raw[6:].strip()
                    if data == b"[DONE]":
                        done = True
                        break
                    frame = json.loads(data)
                    if "error" in frame:
                        results["errors"] += 1
                        break
                    if frame.get("usage"):
                        usage = frame["usage"]["completion_tokens"]
                    for choice in frame.get("choices", ()):
                        text += choice["delta"].get("content") or ""
            if done and (text, usage) == expected[i]:
                results["ok"] += 1
                results["tokens"] += usage
            elif done:
                results["mismatch"] += 1
                mismatches.append((i, text[:80], expected[i][0][:80]))

    connector = aiohttp.TCPConnector(limit=0)
    started = time.monotonic()
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=SECONDS + 120)) as s:
        await asyncio.gather(*(client(s, c) for c in range(STREAMS)))
    wall = time.monotonic() - started
    print(f"\nsoak: {STREAMS} streams x {SECONDS:.0f}s: {results} in {wall:.1f}s "
          f"({results['ok'] / wall:.1f} answers/s, {results['tokens'] / wall:.0f} tokens/s)")
    assert results["mismatch"] == 0, mismatches[:5]
    assert results["errors"] == 0
    assert results["ok"] >= STREAMS  # every client finished at least one answer
    m = scrape(gw.url)
    assert total(m, "dgw_requests_total", status="200") == results["ok"]
    assert total(m, "dgw_inflight_requests") == 0
