"""The gateway served by granian (`http_server = "granian"`, infra/granian_host.py) end to end:
the real openai SDK streams a chat completion through it from a sim worker, and a stop signal
turns `/ready` to 503 while the listener stays open for `shutdown_delay_s`; several
processes are refused (the supervisor's shared socket is uvicorn's)."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from harness.launch import CLI, Gateway
from tests.gateways import one_worker_gateway

MODEL = "DeepSeek-V4.1-Flash"


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[Gateway]:
    with one_worker_gateway(tmp_path, 'http_server = "granian"\nshutdown_delay_s = 2\n') as gw:
        yield gw


def test_the_openai_sdk_streams_a_chat_completion_through_granian(gateway: Gateway) -> None:
    assert httpx.get(gateway.url + "/ready").headers["server"] == "granian"
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="none", max_retries=0, timeout=60)
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Tell me about prefix caching."}], max_tokens=32,
        stream=True, stream_options={"include_usage": True})
    content, finish, usage = [], None, None
    for chunk in stream:
        if chunk.choices:
            content.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        usage = chunk.usage or usage
    assert "".join(content)
    assert finish in ("stop", "length")
    assert usage is not None and 0 < usage.completion_tokens <= 32


def test_a_stop_signal_turns_ready_to_503_while_the_listener_stays_open(gateway: Gateway) -> None:
    assert httpx.get(gateway.url + "/ready").status_code == 200
    gateway.proc.proc.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    while (status := httpx.get(gateway.url + "/ready").status_code) == 200:
        assert time.monotonic() - signalled < 1.0, "still ready 1 s after SIGTERM"
        time.sleep(0.02)
    assert status == 503
    while time.monotonic() - signalled < 1.5:  # shutdown_delay_s is 2
        assert httpx.get(gateway.url + "/ready").status_code == 503
        time.sleep(0.1)
    assert gateway.proc.proc.wait(timeout=10) == 0
    assert time.monotonic() - signalled >= 2.0


def test_several_processes_are_refused(tmp_path: Path) -> None:
    config = tmp_path / "gateway.toml"
    config.write_text('http_server = "granian"\n')
    done = subprocess.run(CLI + ["serve", "--config", str(config), "--processes", "2"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode != 0
    assert "http_server granian serves one process only, not 2" in done.stderr
