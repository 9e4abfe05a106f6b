"""`router.routed_prefix_s` through the live gateway and the openai SDK: two requests that share a
long prefix, the second sent while the first is still being prefilled (before its worker's KV
events can say it holds the prefix). On, the second follows the first to its worker and finds the
prefix cached; off, it goes to the idle worker and computes it again."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import openai
import pytest

from harness.launch import Gateway, SimCluster

MODEL = "DeepSeek-V4.1-Flash"
PREFIX = " ".join(f"shared{i}" for i in range(6000))  # ~18k tokens: a prefill of ~0.3 sim s, ~1.2 s at TIME_SCALE
# The sim at a quarter of real speed: the second request, prepared on a loaded box, still comes
# while the first is being prefilled, before its KV events can say where the prefix is.
TIME_SCALE = 0.25


async def _served(client: openai.AsyncOpenAI, tail: str) -> tuple[str, int]:
    """(the worker that served it, cached prompt tokens) of one request."""
    raw = await client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": PREFIX + tail}], max_tokens=2)
    usage = raw.parse().usage
    details = usage.prompt_tokens_details if usage is not None else None
    return raw.headers["x-dgw-worker"], (details.cached_tokens or 0) if details is not None else 0


async def _until_a_worker_holds_a_request(cluster: SimCluster) -> None:
    async with httpx.AsyncClient(timeout=5) as http:
        for _ in range(500):
            loads = [(await http.get(url + "/v1/worker/load")).json() for url in cluster.urls]
            if any(load["running"] + load["waiting"] for load in loads):
                return
            await asyncio.sleep(0.01)
    raise AssertionError("the first request reached no worker within 5 s")


@pytest.mark.parametrize("routed_prefix_s", [2.0, 0.0])
async def test_a_prefix_routed_a_moment_ago_draws_the_requests_that_share_it(tmp_path: Path,
                                                                            routed_prefix_s: float) -> None:
    cluster = SimCluster("unified:sm100,unified:sm100", time_scale=TIME_SCALE)
    try:
        gw = Gateway(tmp_path, [(url, "unified", "sm100") for url in cluster.urls],
                     extra_toml=f"[router]\nrouted_prefix_s = {routed_prefix_s}\n")
        try:
            gw.wait_ready(2)
            client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0, timeout=60)
            await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=1)  # the client's connection, open
            first = asyncio.create_task(_served(client, " first question"))
            await _until_a_worker_holds_a_request(cluster)  # routed, and its prefill under way
            (worker_a, cached_a), (worker_b, cached_b) = await asyncio.gather(first, _served(client, " second one"))
            assert cached_a == 0
            if routed_prefix_s:
                assert worker_b == worker_a and cached_b >= 6000  # the shared prefix, computed once
            else:
                assert worker_b != worker_a and cached_b == 0  # the idle worker, computing it again
        finally:
            gw.stop()
    finally:
        cluster.stop()
