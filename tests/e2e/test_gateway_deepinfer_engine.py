"""End to end with the DeepInfer wrapper as the engine: what only this engine shows.

Real processes and real HTTP throughout: gateway (`deepinfer-gateway serve`) -> worker
processes (`python -m tests.deepinfer_double.serve`), each running the real CLI path
`worker --engine deepinfer` (DeepInferEngine, its step thread, the worker server) on the
interface double of DeepInfer's LLMEngine in planner mode (the sim's deterministic
OutputPlanner is its "model"). The OpenAI protocol suites (test_gateway_openai.py,
test_protocol_chat.py) run on this cluster too, parametrized over conftest's `engine`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from deepinfer_gateway.gateway.fleet.client_ids import digest_of
from harness.launch import Gateway
from tests.deepinfer_double.serve import start_workers
from tests.e2e.test_gateway_openai import MODEL

# --- this cluster really is the wrapper on the double ------------------------------------------

def test_workers_are_the_deepinfer_wrapper(deepinfer_workers: list[tuple[str, str, str]],
                                          deepinfer_gateway: Gateway) -> None:
    for url, role, hardware in deepinfer_workers:
        info = httpx.get(url + "/v1/worker/info").json()
        assert (info["engine"], info["role"], info["hardware"]) == ("deepinfer", role, hardware)
    assert httpx.get(deepinfer_gateway.url + "/ready").json()["healthy_workers"] == len(deepinfer_workers)


def test_multi_token_steps_reach_the_client_whole(deepinfer_workers: list[tuple[str, str, str]]) -> None:
    """The --mtp worker emits several tokens per step; the same request on a one-token
    worker yields the same ids (planner mode is deterministic), in more events."""
    from deepinfer_gateway.recipe_bridge.tokenizer import load_tokenizer

    ids = list(load_tokenizer().tokenizer.encode("<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜><think>"))

    def run(url: str) -> list[list[int]]:  # the ids of each `tokens` event
        body = {"request_id": f"mtp-{url}", "token_ids": ids, "sampling": {"max_tokens": 200}}
        lines = [json.loads(line) for line in httpx.post(url + "/v1/worker/generate", json=body).text.splitlines()]
        assert lines[-1]["event"] == "finish" and lines[-1]["reason"] == "stop"
        return [e["token_ids"] for e in lines if e["event"] == "tokens"]

    one, many = run(deepinfer_workers[0][0]), run(deepinfer_workers[1][0])
    assert [t for e in one for t in e] == [t for e in many for t in e]
    assert max(map(len, many)) > 1 and len(many) < len(one)


# --- PD: prefill -> KV store -> decode, through the gateway ----------------------------------
# DeepInfer's COMPLETION engine never prefills (no prefill channel), so the wrapper's decode
# workers refuse the gateway's PD bypass (role unified on a decode worker). Their pool needs
# `[router] pd_bypass_tokens = 0`; the default (256) is a known failure, kept visible below.
NO_BYPASS = "[router]\npd_bypass_tokens = 0"


@pytest.fixture(scope="module")
def pd_workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[tuple[str, str, str]]]:
    """A prefill and a decode worker sharing a FileKvStore directory."""
    kv = str(tmp_path_factory.mktemp("pd-kv"))
    with start_workers([(role, "sm100", ["--kv-store-dir", kv]) for role in ("prefill", "decode")]) as workers:
        yield workers


@pytest.fixture(scope="module")
def pd_gateway(pd_workers: list[tuple[str, str, str]], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    gw = Gateway(tmp_path_factory.mktemp("gw-pd"), pd_workers, extra_toml=NO_BYPASS)
    try:
        gw.wait_ready(len(pd_workers), timeout=30)
        yield gw
    finally:
        gw.stop()


def _chat(url: str, text: str) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", timeout=60,
                      json={"model": MODEL, "messages": [{"role": "user", "content": text}], "seed": 3})


def _same_answer(pd: httpx.Response, unified: httpx.Response, prefill_url: str) -> None:
    assert pd.status_code == 200, pd.text
    # first leg on the prefill worker: a PD run
    assert pd.headers["x-dgw-worker"] == digest_of(prefill_url.split("://", 1)[1])
    assert pd.json()["choices"][0] == unified.json()["choices"][0]
    assert pd.json()["usage"]["completion_tokens"] == unified.json()["usage"]["completion_tokens"]


@pytest.mark.parametrize("prompt",
                         ["Hi", "Summarise: " + " ".join(f"point {i} is block {i * 7 % 100}." for i in range(60))])
def test_pd_answer_equals_the_unified_answer(pd_workers: list[tuple[str, str, str]], pd_gateway: Gateway,
                                             deepinfer_gateway: Gateway, prompt: str) -> None:
    """Prefill hands the KV off through the store; decode continues the same stream."""
    _same_answer(_chat(pd_gateway.url, prompt), _chat(deepinfer_gateway.url, prompt), pd_workers[0][0])


def test_pd_with_default_router_settings_never_bypasses_to_a_completion_engine(
        pd_workers: list[tuple[str, str, str]], deepinfer_gateway: Gateway,
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """Default pd_bypass_tokens (256): a short prompt would bypass prefill, but a DeepInfer decode
    worker reports `prefills: false`, so it still goes prefill -> decode."""
    gw = Gateway(tmp_path_factory.mktemp("gw-pd-default"), pd_workers)
    try:
        gw.wait_ready(len(pd_workers), timeout=30)
        _same_answer(_chat(gw.url, "Hi"), _chat(deepinfer_gateway.url, "Hi"), pd_workers[0][0])
    finally:
        gw.proc.kill()  # no graceful drain needed: nothing is in flight
