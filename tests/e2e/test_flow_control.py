"""Flow control through the live gateway, real HTTP and the openai SDK, against a sim worker small
enough to saturate (4 sequences at a time, slow prefill): a flex flood does not delay priority or
default requests past their target; flex is refused with 429 + Retry-After while the others are
served; a client that leaves while queued leaves the queue at once; service_tier is echoed."""

from __future__ import annotations

import asyncio
import contextlib
import json
import statistics
import time
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from harness.launch import Gateway, SimCluster
from tests.gateways import api_key
from tests.sim_profiles import small_sm100

MODEL = "DeepSeek-V4.1-Flash"
PROFILE = small_sm100()
PROMPT = [{"role": "user", "content": "tell me about flow control " * 20}]


def _key(name: str, key: str, tier: str) -> str:
    return api_key(name, key, service_tier=tier)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimCluster]:
    profile = tmp_path_factory.mktemp("flow-profile") / "profiles.toml"
    profile.write_text(PROFILE)
    cluster = SimCluster("unified:sm100", time_scale=1.0, extra=["--profiles", str(profile)])
    yield cluster
    cluster.stop()


def _gateway(tmp: Path, cluster: SimCluster, flow: str) -> Gateway:
    keys = (_key("batch", "sk-batch", "flex") + _key("chat", "sk-chat", "default") + _key("vip", "sk-vip", "priority")
            + _key("other-batch", "sk-batch2", "flex")) if flow else _key("chat", "sk-chat", "default")
    extra = ("[router.hardware.sm100]\nprefill_tokens_per_s = 20000.0\nkv_load_bytes_per_s = 25e9\n"
             + flow + keys)
    gw = Gateway(tmp, [(cluster.urls[0], "unified", "sm100")], extra_toml=extra)
    gw.wait_ready(1)
    return gw


FLOW = """[flow_control]
enabled = true
max_engine_wait_ms = 100
max_engine_waiting = 2
priority_ttft_ms = 1500
default_ttft_ms = 4000
flex_ttft_ms = {flex}
"""


@pytest.fixture(scope="module")
def gateway(cluster: SimCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    gw = _gateway(tmp_path_factory.mktemp("flow"), cluster, FLOW.format(flex=20000))
    yield gw
    gw.stop()


def client(gw: Gateway, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0, timeout=60)


async def _ttft(gw: Gateway, key: str, tier: str | None = None) -> float:
    return await ttft_of(client(gw, key), tier)


async def ttft_of(c: openai.AsyncOpenAI, tier: str | None = None) -> float:
    """Seconds to the first chunk of a short streamed chat request."""
    started = time.perf_counter()
    extra = {"service_tier": tier} if tier else {}
    stream = await c.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=4, stream=True, **extra)
    first = None
    async for _ in stream:
        first = first or time.perf_counter()
    assert first is not None
    return first - started


async def _flood(gw: Gateway, key: str, stop: asyncio.Event, outcomes: list[int], max_tokens: int = 30) -> None:
    c = client(gw, key)
    while not stop.is_set():
        try:
            await c.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=max_tokens)
            outcomes.append(200)
        except openai.RateLimitError as exc:
            assert int(exc.response.headers["retry-after"]) >= 1
            outcomes.append(429)
            await asyncio.sleep(0.05)


async def ttfts_beside(flood: list[asyncio.Task[None]], queued: Awaitable[None],
                       ttft: Callable[[], Awaitable[float]]) -> list[float]:
    """Four TTFTs once flex waits in flow control (`queued`) and the flex requests started first
    are decoding; then the flood's clients leave."""
    await queued
    await asyncio.sleep(1.0)
    ttfts = [await ttft() for _ in range(4)]
    for task in flood:
        task.cancel()
    await asyncio.gather(*flood, return_exceptions=True)
    return ttfts


def _metric(gw: Gateway, name: str, **labels: str) -> float:
    with urllib.request.urlopen(gw.url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()) and want:
            total += float(line.rsplit(" ", 1)[1])
    return total


async def _queued(gw: Gateway, tier: str = "flex", timeout: float = 20.0) -> None:
    """Until requests of `tier` wait in flow control (a loaded machine takes a while to send the flood)."""
    deadline = time.monotonic() + timeout
    while _metric(gw, "dgw_flow_queued_requests", service_tier=tier) == 0:
        assert time.monotonic() < deadline, "the flood never queued"
        await asyncio.sleep(0.1)


def test_flex_flood_does_not_delay_priority_or_default(gateway: Gateway) -> None:
    async def run() -> tuple[list[float], list[float], list[int]]:
        stop, outcomes = asyncio.Event(), list[int]()
        flood = [asyncio.create_task(_flood(gateway, "sk-batch", stop, outcomes)) for _ in range(24)]
        await _queued(gateway)  # the engine's 4 slots are full and flex requests queue in the gateway
        priority = [await _ttft(gateway, "sk-vip", "priority") for _ in range(6)]
        default = [await _ttft(gateway, "sk-chat") for _ in range(6)]
        stop.set()
        await asyncio.gather(*flood)
        return priority, default, outcomes

    priority, default, outcomes = asyncio.run(run())
    assert max(priority) < 1.5, priority  # the priority target
    assert max(default) < 4.0, default
    assert outcomes.count(200) > 10  # the flood is served, behind them
    assert _metric(gateway, "dgw_flow_ttft_total", service_tier="priority", met="true") >= 6


def test_flex_is_shed_with_retry_after_while_others_are_served(cluster: SimCluster,
                                                              tmp_path_factory: pytest.TempPathFactory) -> None:
    gw = _gateway(tmp_path_factory.mktemp("flow-shed"), cluster, FLOW.format(flex=400))
    try:
        async def run() -> tuple[list[int], list[float]]:
            stop, outcomes = asyncio.Event(), list[int]()
            flood = [asyncio.create_task(_flood(gw, "sk-batch", stop, outcomes, max_tokens=60)) for _ in range(24)]
            await _queued(gw)
            served = [await _ttft(gw, "sk-chat") for _ in range(5)]
            stop.set()
            await asyncio.gather(*flood)
            return outcomes, served

        outcomes, served = asyncio.run(run())
        assert outcomes.count(429) > 0 and outcomes.count(200) > 0
        assert max(served) < 4.0  # every default request served, none refused
        assert _metric(gw, "dgw_flow_shed_total", service_tier="flex") > 0
        assert _metric(gw, "dgw_flow_shed_total", service_tier="default") == 0
    finally:
        gw.stop()


def test_a_tenant_whose_share_is_too_small_for_its_deadline_is_counted_starved(
        cluster: SimCluster, tmp_path_factory: pytest.TempPathFactory) -> None:
    """"batch" (weight 100) floods flex; "other-batch" (weight 1) sends two requests with a 3 s
    target: its first starts, its second waits behind a hundred of batch's and is refused at its
    deadline while batch's later requests start: counted in dgw_flow_starved_total."""
    flow = FLOW.format(flex=20000) + '[flow_control.tenant_weights]\nbatch = 100.0\n'
    gw = _gateway(tmp_path_factory.mktemp("flow-starved"), cluster, flow)
    try:
        async def run() -> list[int]:
            stop, outcomes = asyncio.Event(), list[int]()
            flood = [asyncio.create_task(_flood(gw, "sk-batch", stop, outcomes)) for _ in range(24)]
            await _queued(gw)
            light = client(gw, "sk-batch2")

            async def one() -> int:
                try:
                    await light.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=4,
                                                        extra_headers={"x-slo-ttft-ms": "3000"})
                    return 200
                except openai.RateLimitError:
                    return 429

            statuses = await asyncio.gather(one(), one())
            stop.set()
            await asyncio.gather(*flood)
            return sorted(statuses)

        assert asyncio.run(run()) == [200, 429]
        assert _metric(gw, "dgw_flow_starved_total", service_tier="flex") == 1
        assert _metric(gw, "dgw_flow_shed_total", service_tier="flex", reason="deadline") >= 1
    finally:
        gw.stop()


@pytest.mark.parametrize("share", [0.5, 1.0])
def test_flex_share_keeps_slots_for_the_tiers_above(cluster: SimCluster, tmp_path_factory: pytest.TempPathFactory,
                                                    share: float) -> None:
    """Long flex answers (4 s each) hold the worker's slots: with flex held to half of the 4 slots a
    default request starts at once; with no cap it waits for a flex answer to end."""
    gw = _gateway(tmp_path_factory.mktemp("flow-share"), cluster,
                  FLOW.format(flex=60000) + f"flex_max_share = {share}\n")
    try:
        async def run() -> list[float]:
            stop, outcomes = asyncio.Event(), list[int]()
            flood = [asyncio.create_task(_flood(gw, "sk-batch", stop, outcomes, max_tokens=240)) for _ in range(12)]
            return await ttfts_beside(flood, _queued(gw), lambda: _ttft(gw, "sk-chat"))

        default = asyncio.run(run())
        if share < 1.0:
            assert max(default) < 0.5, default
        else:  # the control: without the share the same requests wait for a slot
            assert statistics.median(default) > 0.5, default
    finally:
        gw.stop()


@pytest.fixture(scope="module")
def preempting(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimCluster]:
    """The same worker scheduling by priority: a request of a tier above preempts flex."""
    profile = tmp_path_factory.mktemp("flow-preempt-profile") / "profiles.toml"
    profile.write_text(small_sm100(scheduling_policy="priority"))
    cluster = SimCluster("unified:sm100", time_scale=1.0, extra=["--profiles", str(profile)])
    yield cluster
    cluster.stop()


def test_where_the_engine_preempts_flex_takes_every_slot_and_the_tiers_above_start_at_once(
        preempting: SimCluster, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Long flex answers hold all 4 slots (no share, no yield: the worker says it preempts); a default
    request gets its tier's engine priority and preempts one at once; the preempted answer resumes
    and ends whole."""
    gw = _gateway(tmp_path_factory.mktemp("flow-preempt"), preempting,
                  FLOW.format(flex=60000) + "flex_max_share = 0.5\nflex_yield_window_ms = 10000\n")
    try:
        async def flood(stop: asyncio.Event, lengths: list[int]) -> None:
            c = client(gw, "sk-batch")
            while not stop.is_set():
                answer = await c.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=240,
                                                         extra_body={"ignore_eos": True})
                assert answer.usage is not None
                lengths.append(answer.usage.completion_tokens)

        async def run() -> tuple[list[float], list[int]]:
            stop, lengths = asyncio.Event(), list[int]()
            flood_tasks = [asyncio.create_task(flood(stop, lengths)) for _ in range(6)]
            await _queued(gw)
            await asyncio.sleep(1.0)  # the flex requests started first are decoding, in every slot
            default = [await _ttft(gw, "sk-chat") for _ in range(4)]
            stop.set()
            await asyncio.gather(*flood_tasks)  # every flex answer ends, the preempted ones included
            return default, lengths

        default, lengths = asyncio.run(run())
        assert max(default) < 0.5, default
        assert lengths and set(lengths) == {240}, lengths
        with urllib.request.urlopen(preempting.urls[0] + "/v1/worker/load", timeout=5) as r:
            assert json.loads(r.read())["preemptions_total"] >= 4
        deadline = time.monotonic() + 5  # the gateway shows the engine's count from its load reports
        worker = preempting.urls[0].split("://", 1)[1]
        while _metric(gw, "dgw_worker_preemptions", worker=worker) < 4:
            assert time.monotonic() < deadline, "dgw_worker_preemptions never showed the engine's preemptions"
            time.sleep(0.1)
    finally:
        gw.stop()


def test_client_leaving_while_queued_leaves_the_queue(gateway: Gateway) -> None:
    async def run() -> tuple[float, float, float, float]:
        stop, outcomes = asyncio.Event(), list[int]()
        # long requests: nothing ends during the test, so the queue holds still
        flood = [asyncio.create_task(_flood(gateway, "sk-chat", stop, outcomes, max_tokens=3000)) for _ in range(12)]
        await _queued(gateway, "default")
        body = {"model": MODEL, "messages": PROMPT, "max_tokens": 4}
        # a flex request: it waits behind the default ones, alone in its tier (the flood's clients
        # refused at their deadline retry, so the default queue's depth moves)
        before = _metric(gateway, "dgw_flow_queued_requests", service_tier="flex")
        async with httpx.AsyncClient(base_url=gateway.url) as http:
            queued = asyncio.create_task(http.post("/v1/chat/completions", json=body, timeout=30,
                                                   headers={"authorization": "Bearer sk-batch"}))
            await asyncio.sleep(0.5)
            during = _metric(gateway, "dgw_flow_queued_requests", service_tier="flex")
            queued.cancel()  # the client goes away
            with contextlib.suppress(asyncio.CancelledError):
                await queued
        await asyncio.sleep(0.3)
        after = _metric(gateway, "dgw_flow_queued_requests", service_tier="flex")
        for task in flood:
            task.cancel()
        await asyncio.gather(*flood, return_exceptions=True)
        await asyncio.sleep(0.5)
        return before, during, after, sum(_metric(gateway, "dgw_flow_queued_requests", service_tier=tier)
                                          for tier in ("priority", "default", "flex"))

    before, during, after, drained = asyncio.run(run())
    assert (before, during) == (0, 1)
    assert after == 0  # gone at once, not when its turn came
    assert drained == 0  # the flood's clients left too


def test_service_tier_is_echoed_as_run(gateway: Gateway) -> None:
    async def run() -> list[str | None]:
        chat = client(gateway, "sk-chat")
        asked = await chat.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=2, service_tier="flex")
        capped = await chat.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=2,
                                                    service_tier="priority")
        vip = await client(gateway, "sk-vip").chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=2)
        streamed = await chat.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=2, stream=True,
                                                      service_tier="flex")
        tiers = [chunk.service_tier async for chunk in streamed]
        assert tiers and set(tiers) == {"flex"}
        answer = await chat.responses.create(model=MODEL, input="hi", max_output_tokens=2, service_tier="flex")
        assert answer.service_tier == "flex" and answer.to_json().count('"service_tier"') == 1
        events = await chat.responses.create(model=MODEL, input="hi", max_output_tokens=2, service_tier="flex",
                                             stream=True)
        carried = [e.response.service_tier async for e in events if hasattr(e, "response")]
        assert carried and set(carried) == {"flex"}
        for key, tier in (("sk-vip", "priority"), ("sk-chat", "standard")):
            message = await anthropic.AsyncAnthropic(base_url=gateway.url, api_key=key, max_retries=0).messages.create(
                model=MODEL, messages=PROMPT, max_tokens=2)
            assert message.usage.service_tier == tier
        return [asked.service_tier, capped.service_tier, vip.service_tier]

    assert asyncio.run(run()) == ["flex", "default", "priority"]


def test_bad_flow_headers_are_400(gateway: Gateway) -> None:
    async def run() -> None:
        chat = client(gateway, "sk-chat")
        for headers in ({"x-slo-ttft-ms": "soon"}, {"x-dgw-service-tier": "priority"}):
            with pytest.raises(openai.BadRequestError):
                await chat.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=2, extra_headers=headers)
        ok = await chat.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=2,
                                                extra_headers={"x-slo-ttft-ms": "3000"})
        assert ok.choices

    asyncio.run(run())


def test_without_flow_control_only_the_default_tier_is_accepted(cluster: SimCluster,
                                                                 tmp_path_factory: pytest.TempPathFactory) -> None:
    gw = _gateway(tmp_path_factory.mktemp("flow-off"), cluster, "")
    try:
        c = openai.OpenAI(base_url=gw.url + "/v1", api_key="sk-chat", max_retries=0, timeout=30)
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=2, service_tier="flex")
        assert "flow control is off" in e.value.message
        assert c.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=2,
                                         service_tier="default").service_tier == "default"
    finally:
        gw.stop()
