"""Flow control in the EPP, end to end: the openai SDK -> a real Envoy -> `deepinfer-gateway epp` with
`[flow_control]` on -> a sim worker small enough to saturate. A flex flood is held in the EPP and
refused with 429 + Retry-After (Envoy's immediate response, in OpenAI's error format) while default
requests are served; a request whose client leaves while it waits leaves the EPP's queue."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from harness.launch import Envoy, Epp, SimCluster
from tests.e2e.test_epp_envoy import wait_ready
from tests.e2e.test_flow_control import PROFILE, PROMPT, ttft_of, ttfts_beside
from tests.fault_doubles import scrape, total
from tests.sim_profiles import small_sm100

pytestmark = pytest.mark.timeout(300)

MODEL = "DeepSeek-V4.1-Flash"
FLOW = """[router.hardware.sm100]
prefill_tokens_per_s = 20000.0
kv_load_bytes_per_s = 25e9
[flow_control]
enabled = true
max_engine_wait_ms = 100
max_engine_waiting = 2
default_ttft_ms = 4000
flex_ttft_ms = 600
"""


class FlowStack:
    def __init__(self, epp: Epp, envoy: Envoy) -> None:
        self.epp, self.envoy = epp, envoy

    def client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.envoy.url + "/v1", api_key="sk-any", max_retries=0, timeout=60)

    def metric(self, name: str, **labels: str) -> float:
        return total(scrape(self.epp.url), name, **labels)


@contextlib.contextmanager
def flow_stack(tmp: Path, profile_text: str, toml: str) -> Iterator[FlowStack]:
    """A sim worker with `profile_text`, the EPP with `toml`, Envoy; the worker warmed up."""
    profile = tmp / "profiles.toml"
    profile.write_text(profile_text)
    cluster = SimCluster("unified:sm100", time_scale=1.0, extra=["--profiles", str(profile)])
    epp = envoy = None
    try:
        epp = Epp(tmp, [(cluster.urls[0], "unified", "sm100")], extra_toml=toml, fallbacks=0)
        envoy = Envoy(tmp, "epp-original-dst.yaml", epp.grpc_port)
        wait_ready(epp)
        # the worker's first chat request loads its tokenizer (seconds): not under the flood's deadlines
        body = {"model": MODEL, "messages": PROMPT, "max_tokens": 2}
        assert httpx.post(envoy.url + "/v1/chat/completions", json=body, timeout=120).status_code == 200
        yield FlowStack(epp, envoy)
    finally:
        for proc in (envoy, epp, cluster):
            if proc is not None:
                proc.stop()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FlowStack]:
    with flow_stack(tmp_path_factory.mktemp("epp-flow"), PROFILE, FLOW) as stack:
        yield stack


async def _flood(client: openai.AsyncOpenAI, stop: asyncio.Event, outcomes: list[int], max_tokens: int,
                 tier: str = "flex", slo_ms: int | None = None, whole: bool = False) -> None:
    """`whole`: every answer runs to `max_tokens` (ignore_eos)."""
    headers = {"x-slo-ttft-ms": str(slo_ms)} if slo_ms else None
    extra = {"ignore_eos": True} if whole else None
    while not stop.is_set():
        try:
            await client.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=max_tokens,
                                                 service_tier=tier, extra_headers=headers, extra_body=extra)
            outcomes.append(200)
        except openai.RateLimitError as exc:
            assert int(exc.response.headers["retry-after"]) >= 1
            assert exc.body["type"] == "rate_limit_error"
            outcomes.append(429)
            await asyncio.sleep(0.05)


async def _queued(stack: FlowStack, tier: str = "flex", timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while stack.metric("dgw_flow_queued_requests", service_tier=tier) == 0:
        assert time.monotonic() < deadline, "the flood never queued in the EPP"
        await asyncio.sleep(0.1)


def test_flex_flood_is_held_and_shed_while_default_is_served(stack: FlowStack) -> None:
    async def run() -> tuple[list[int], list[float]]:
        stop, outcomes = asyncio.Event(), list[int]()
        flood = [asyncio.create_task(_flood(stack.client(), stop, outcomes, 60)) for _ in range(16)]
        await _queued(stack)
        served = []
        for _ in range(4):
            started = time.perf_counter()
            answer = await stack.client().chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=4)
            assert answer.choices
            served.append(time.perf_counter() - started)
        stop.set()
        await asyncio.gather(*flood)
        return outcomes, served

    outcomes, served = asyncio.run(run())
    assert outcomes.count(429) > 0 and outcomes.count(200) > 0
    assert max(served) < 4.0, served
    assert stack.metric("dgw_flow_shed_total", service_tier="flex") > 0
    assert stack.metric("dgw_flow_shed_total", service_tier="default") == 0


def test_client_leaving_while_queued_in_the_epp(stack: FlowStack) -> None:
    async def run() -> tuple[float, float, float]:
        stop, outcomes = asyncio.Event(), list[int]()
        # default requests with long answers and a long target fill the engine and the EPP's queue
        flood = [asyncio.create_task(_flood(stack.client(), stop, outcomes, 3000, "default", 60_000))
                 for _ in range(10)]
        await _queued(stack, "default")
        # a flex request (with a long target of its own) waits behind every default one
        before = stack.metric("dgw_flow_queued_requests", service_tier="flex")
        body = {"model": MODEL, "messages": PROMPT, "max_tokens": 4, "service_tier": "flex"}
        async with httpx.AsyncClient(base_url=stack.envoy.url) as http:
            waiting = asyncio.create_task(http.post("/v1/chat/completions", json=body, timeout=30,
                                                    headers={"authorization": "Bearer sk-other",
                                                             "x-slo-ttft-ms": "60000"}))
            deadline = time.monotonic() + 10
            while (during := stack.metric("dgw_flow_queued_requests", service_tier="flex")) == before:
                assert time.monotonic() < deadline and not waiting.done(), "the flex request never queued"
                await asyncio.sleep(0.05)
            waiting.cancel()  # the client goes away
            with contextlib.suppress(asyncio.CancelledError):
                await waiting
        await asyncio.sleep(0.5)
        after = stack.metric("dgw_flow_queued_requests", service_tier="flex")
        for task in flood:
            task.cancel()
        await asyncio.gather(*flood, return_exceptions=True)
        return before, during, after

    before, during, after = asyncio.run(run())
    assert (before, during, after) == (0, 1, 0)


def test_the_epp_keeps_flexs_slot_share_where_the_workers_preempt(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The worker preempts by priority, but Envoy forwards the client's body: the engine gets no tier
    from the EPP, so the EPP keeps flex to half of the 4 slots and a default request starts at once
    while long flex answers fill the other half."""
    toml = FLOW.replace("flex_ttft_ms = 600", "flex_ttft_ms = 60000") + "flex_max_share = 0.5\n"
    with flow_stack(tmp_path_factory.mktemp("epp-flow-preempt"), small_sm100(scheduling_policy="priority"),
                    toml) as stack:
        async def run() -> list[float]:
            stop, outcomes = asyncio.Event(), list[int]()
            flood = [asyncio.create_task(_flood(stack.client(), stop, outcomes, 240, whole=True)) for _ in range(8)]
            return await ttfts_beside(flood, _queued(stack), lambda: ttft_of(stack.client()))

        served = asyncio.run(run())
        assert max(served) < 0.5, served
