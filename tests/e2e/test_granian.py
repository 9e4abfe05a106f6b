"""The gateway app served by granian (bench/_granian.py, for bench/gateway_capacity.py --server
granian) answers the openai SDK, streamed and not: the relay steps any ASGI server's `send`
awaitable, not only uvicorn's coroutines (gateway/serving/relay.py `_sink`)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import openai

from harness.launch import SimCluster

MODEL = "DeepSeek-V4.1-Flash"
BENCH = Path(__file__).resolve().parents[2] / "bench" / "_granian.py"


def test_the_app_under_granian_streams_through_the_relay() -> None:
    spec = importlib.util.spec_from_file_location("bench_granian", BENCH)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    cluster = SimCluster("unified:sm100", time_scale=1.0)  # a step per message: the relay's direct path
    try:
        gateway = bench.GranianGateway(cluster.urls[0])
        try:
            gateway.wait_ready(1)
            client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="none", max_retries=0, timeout=30)
            messages = [{"role": "user", "content": "Count to forty."}]
            stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, stream=True,
                                                    stream_options={"include_usage": True})
            chunks = list(stream)
            deltas = [c.choices[0].delta for c in chunks if c.choices]  # the answer, and reasoning before it
            usage = chunks[-1].usage
            assert len(deltas) >= 8 and usage is not None and usage.completion_tokens == 40
            whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40)
            assert whole.usage is not None and whole.usage.completion_tokens == 40
            assert whole.choices[0].finish_reason == "length"
        finally:
            gateway.stop()
    finally:
        cluster.stop()
