"""Limits and safety through a gateway of the test's own (small limits, remote images on):
body size -> 413, prompt over the context -> 400 naming both numbers, image count and
SSRF destination filter; client disconnect mid-stream aborts the worker request."""

from __future__ import annotations

import base64
import http.server
import io
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from PIL import Image

from deepinfer_gateway.recipe_bridge.images import AllowList, destination_allowed
from harness.launch import Gateway

MODEL = "DeepSeek-V4.1-Flash"
CONTEXT = 2048


def _png_bytes() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (32, 32), (0, 128, 255)).save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def image_server() -> Iterator[str]:
    png = _png_bytes()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("content-type", "image/png")
            self.send_header("content-length", str(len(png)))
            self.end_headers()
            self.wfile.write(png)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def small_gateway(sim_cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    roles = [spec.split(":") for spec in sim_cluster.specs]
    extra = "\n".join([f"max_body_bytes = {64 * 1024}", f"context_limit = {CONTEXT}", "[images]",
                       "max_images = 2", "remote_fetch = true", 'allow = ["localhost"]', ""])
    gw = Gateway(tmp_path_factory.mktemp("small"),
                 [(u, r, h) for u, (r, h) in zip(sim_cluster.urls, roles, strict=True)],
                 extra_toml=extra)
    gw.wait_ready(len(roles))
    yield gw
    gw.stop()


def _image_chat(*urls: str) -> dict[str, Any]:
    parts = [{"type": "text", "text": "Describe."}] + [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": parts}]}


def test_body_over_the_limit_is_413_in_each_protocols_format(small_gateway: Gateway) -> None:
    big = "x " * 40_000
    r = httpx.post(small_gateway.url + "/v1/chat/completions",
                   json={"model": MODEL, "messages": [{"role": "user", "content": big}]})
    assert r.status_code == 413 and "65536" in r.json()["error"]["message"]
    r = httpx.post(small_gateway.url + "/v1/messages",
                   json={"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": big}]})
    assert r.status_code == 413 and r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "request_too_large"


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/responses"])
def test_prompt_over_the_context_limit_names_both_numbers(small_gateway: Gateway, path: str) -> None:
    text = " ".join(f"w{i}" for i in range(3000))  # > 2,048 tokens, < 64 KiB
    body: dict[str, Any] = {"model": MODEL}
    if path == "/v1/completions":
        body["prompt"] = text
    elif path == "/v1/responses":
        body["input"] = text
    else:
        body["messages"] = [{"role": "user", "content": text}]
    r = httpx.post(small_gateway.url + path, json=body)
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert str(CONTEXT) in message
    prompt_tokens = next(int(w) for w in message.replace("(", " ").split() if w.isdigit() and int(w) > CONTEXT)
    assert prompt_tokens > CONTEXT


def test_max_tokens_is_clamped_to_the_context_left(small_gateway: Gateway) -> None:
    client = openai.OpenAI(base_url=small_gateway.url + "/v1", api_key="x", max_retries=0)
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                         extra_body={"ignore_eos": True, "thinking": {"type": "disabled"}})
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens + out.usage.completion_tokens == CONTEXT


def test_image_count_limit(small_gateway: Gateway) -> None:
    url = "data:image/png;base64," + base64.b64encode(_png_bytes()).decode()
    assert httpx.post(small_gateway.url + "/v1/chat/completions", json=_image_chat(url, url)).status_code == 200
    r = httpx.post(small_gateway.url + "/v1/chat/completions", json=_image_chat(url, url, url))
    assert r.status_code == 400 and "Too many images: 3" in r.json()["error"]["message"]


def test_remote_fetch_goes_through_the_destination_filter(small_gateway: Gateway, image_server: str) -> None:
    allowed = httpx.post(small_gateway.url + "/v1/chat/completions",
                         json=_image_chat(f"http://localhost:{image_server}/a.png"))
    assert allowed.status_code == 200, allowed.text  # "localhost" is allow-listed
    for url in (f"http://127.0.0.1:{image_server}/a.png", "http://169.254.169.254/latest/meta-data",
                "http://[fd00:ec2::254]/latest", "http://10.0.0.1/x.png"):
        r = httpx.post(small_gateway.url + "/v1/chat/completions", json=_image_chat(url))
        assert r.status_code == 400, url
        assert "DestinationRejected" in r.json()["error"]["message"]


@pytest.mark.parametrize(("address", "ok"), [
    ("8.8.8.8", True), ("2606:4700::1111", True), ("127.0.0.1", False), ("::1", False), ("10.1.2.3", False),
    ("172.16.0.1", False), ("192.168.1.1", False), ("169.254.169.254", False), ("fd00:ec2::254", False),
    ("fe80::1", False), ("100.64.0.1", False), ("0.0.0.0", False), ("224.0.0.1", False), ("::ffff:127.0.0.1", False),
    ("::ffff:10.0.0.1", False), ("not-an-ip", False),
])
def test_destination_filter_refuses_non_global_addresses(address: str, ok: bool) -> None:
    assert destination_allowed("example.com", address) is ok


def test_allow_list_admits_hosts_and_cidrs() -> None:
    allow = AllowList.parse(["images.internal", "10.20.0.0/16"])
    assert destination_allowed("images.internal", "10.9.9.9", allow)
    assert destination_allowed("other", "10.20.3.4", allow)
    assert not destination_allowed("other", "10.21.3.4", allow)


def _loads(urls: list[str]) -> list[tuple[int, int]]:
    return [(j["running"], j["waiting"]) for j in (httpx.get(u + "/v1/worker/load").json() for u in urls)]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/messages"])
def test_client_disconnect_mid_stream_aborts_the_worker_request_within_1s(gateway, sim_cluster, path: str) -> None:
    body: dict[str, Any] = {"model": MODEL, "stream": True, "max_tokens": 20_000, "ignore_eos": True}
    if path == "/v1/completions":
        body["prompt"] = "Tell me a very long story."
    else:
        body["messages"] = [{"role": "user", "content": "Tell me a very long story."}]
    with httpx.Client(timeout=30) as client, client.stream("POST", gateway.url + path, json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for _ in range(5):
            next(lines)
        assert sum(run for run, _ in _loads(sim_cluster.urls)) >= 1
    closed = time.monotonic()
    while sum(run + wait for run, wait in _loads(sim_cluster.urls)) and time.monotonic() - closed < 1.0:
        time.sleep(0.02)
    assert _loads(sim_cluster.urls) == [(0, 0)] * len(sim_cluster.urls), "worker request still running 1 s later"
