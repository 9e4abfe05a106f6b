"""estimated_ttft's lockstep pricing through the real gateway (router/policies.py): a request that
would hit its prefix on a worker whose DP ranks are in the middle of a long prefill step waits
for that step there, so with `lockstep_under_way` it goes to an idle worker instead; without it,
to the hit. The decision log shows what the pricing read from the bookings."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from deepinfer_gateway.gateway.fleet.client_ids import digest_of
from harness.launch import Gateway, SimCluster

MODEL = "DeepSeek-V4.1-Flash"
TIME_SCALE = 0.25  # the long prefill below is one step of ~0.75 s wall time
# The sim's sm100 at TIME_SCALE: the cost model's prefill speed matches the workers' wall time.
HARDWARE = f"[router.hardware.sm100]\nprefill_tokens_per_s = {340_000 * TIME_SCALE}\nkv_load_bytes_per_s = 25e9\n"


@pytest.fixture(scope="module")
def two_workers() -> Iterator[SimCluster]:
    cluster = SimCluster("unified:sm100,unified:sm100", time_scale=TIME_SCALE)
    yield cluster
    cluster.stop()


def _words(start: int, count: int) -> str:
    return " ".join(f"w{i}" for i in range(start, start + count))


def _ask(client: openai.OpenAI, text: str) -> str:
    """The worker that served `text` (its digest, as the response header gives it)."""
    reply = client.chat.completions.with_raw_response.create(
        model=MODEL, max_tokens=2, messages=[{"role": "user", "content": text}])
    return reply.headers["x-dgw-worker"]


@pytest.mark.parametrize("under_way", [True, False])
def test_a_hit_behind_a_long_step_goes_to_an_idle_worker_only_when_the_step_is_priced(
        two_workers: SimCluster, tmp_path: Path, under_way: bool) -> None:
    log = tmp_path / "decisions.jsonl"
    policy = ('[router.policy]\nname = "estimated_ttft"\nlockstep = true\n'
              f"lockstep_under_way = {json.dumps(under_way)}\n")
    gw = Gateway(tmp_path, [(url, "unified", "sm100") for url in two_workers.urls],
                 extra_toml=f"[router]\ndecision_log = {json.dumps(str(log))}\n{policy}{HARDWARE}")
    # Each run its own text: the cluster (and its caches) outlive a parametrization.
    base = 1_000_000 if under_way else 2_000_000
    shared = _words(base, 700)  # ~2,100 tokens
    try:
        gw.wait_ready(2)
        with openai.OpenAI(base_url=gw.url + "/v1", api_key="t", max_retries=0, timeout=60) as client:
            holder = _ask(client, shared)
            time.sleep(0.5)  # its blocks' KV events reach the index
            # ~16,000 new tokens: one step at the ranks' chunk budget, on the holder (the hit)
            long_worker: list[str] = []
            long_prefill = threading.Thread(target=lambda: long_worker.append(
                _ask(client, shared + " " + _words(base + 700, 4_000))))
            long_prefill.start()
            time.sleep(0.25)  # scheduled, and in a load report (which then drops it from the queue)
            follower = _ask(client, shared + " and one more question")
            long_prefill.join()
        assert long_worker == [holder]
        records = [json.loads(line) for line in log.read_text().splitlines()]
        last = [r for r in records if r["prompt_tokens"] < 3_000][-1]  # the follower's (written at its end)
        on_holder = next(c for c in last["candidates"] if digest_of(c["worker"]) == holder)
        # What the pricing reads: the long prefill, scheduled on the holder a moment ago.
        assert on_holder["prefilling_max"] > 12_000 and 0 < on_holder["prefilling_age_s"] < 0.6
        assert on_holder["admitting"] == 0 and on_holder["hit_tokens"] > 1_500
        if under_way:
            assert follower != holder  # its hit would wait out the step: the idle worker is sooner
            assert on_holder["estimate_s"] > 0.1
        else:
            assert follower == holder  # the queue term alone: a cached prefix and an empty queue
    finally:
        gw.stop()
