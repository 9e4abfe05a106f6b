"""Sessions under cache pressure through the live gateway, real HTTP and the openai SDK, against
a sim worker whose KV cache holds one session's context and not two: a second session's round
waits in the gateway while the first session is live (its next round comes back within the TTL
and finds its whole context cached), then goes once the first session's TTL has run out; the same
with flow control on beside it (its queue after the session's wait). A round whose prefix both of two
full workers cache alike waits for whichever has room first."""

from __future__ import annotations

import asyncio
import contextlib
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from deepinfer_gateway.gateway.fleet.client_ids import digest_of
from harness.launch import Gateway, SimCluster
from tests.gateways import one_worker_gateway
from tests.sim_profiles import small_sm100

MODEL = "DeepSeek-V4.1-Flash"
CAPACITY_BLOCKS = 64
PROFILE = small_sm100(CAPACITY_BLOCKS)
TTL_S = 1.5
SESSIONS = f"""[session_capacity]
enabled = true
ttl_ms = {TTL_S * 1000:.0f}
headroom = 0.1
max_wait_ms = 30000
"""
FLOW = """[flow_control]
enabled = true
"""


@pytest.fixture(scope="module", params=["sessions", "sessions-and-flow-control"])
def gateway(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    tmp = tmp_path_factory.mktemp("session-capacity")
    profile = tmp / "profiles.toml"
    profile.write_text(PROFILE)
    settings = SESSIONS + (FLOW if request.param == "sessions-and-flow-control" else "")
    with one_worker_gateway(tmp, settings, time_scale=1.0, worker_args=["--profiles", str(profile)]) as gw:
        yield gw


def _metric(gw: Gateway, name: str) -> float:
    with urllib.request.urlopen(gw.url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def _context(word: str) -> str:
    """About 4,200 tokens private to one session: 34 of the cache's 64 blocks."""
    return " ".join(f"{word}{i}" for i in range(1800))


async def _round(client: openai.AsyncOpenAI, session: str, messages: list[dict[str, str]]
                 ) -> tuple[float, str, int, int]:
    """(seconds to the first token, the answer, prompt tokens, cached tokens) of one streamed round."""
    started = time.perf_counter()
    stream = await client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, stream=True, stream_options={"include_usage": True},
        extra_headers={"x-session-id": session})
    first, answer, prompt, cached = None, "", 0, 0
    async for chunk in stream:
        if chunk.choices:
            first = first or time.perf_counter()
            answer += chunk.choices[0].delta.content or ""
        if chunk.usage is not None:
            prompt = chunk.usage.prompt_tokens
            details = chunk.usage.prompt_tokens_details
            cached = (details.cached_tokens or 0) if details is not None else 0
    assert first is not None
    return first - started, answer, prompt, cached


async def test_a_second_session_waits_for_room_instead_of_evicting_a_live_one(gateway: Gateway,
                                                                             request: pytest.FixtureRequest) -> None:
    client = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="none", max_retries=0, timeout=60)
    waits0 = _metric(gateway, "dgw_session_waits_total")
    first = [{"role": "user", "content": _context("alpha")}]
    _, answer, prompt, _ = await _round(client, "agent-a", first)
    assert CAPACITY_BLOCKS * 128 * 0.9 / 2 < prompt < CAPACITY_BLOCKS * 128 * 0.9  # one fits, two do not

    # Session b's first round: a's context is live on the only worker and b's does not fit beside it.
    other = asyncio.create_task(_round(client, "agent-b", [{"role": "user", "content": _context("bravo")}]))
    await asyncio.sleep(0.3)
    assert not other.done()
    # a's next round, within its TTL, goes at once and finds its whole context cached.
    second = [*first, {"role": "assistant", "content": answer}, {"role": "user", "content": "and the tests?"}]
    _, _, prompt2, cached2 = await _round(client, "agent-a", second)
    a_done = time.perf_counter()
    assert cached2 >= prompt - 128
    assert not other.done()

    # b goes once a's TTL has run out after a's last round, not at its wait's limit.
    ttft_b, _, _, _ = await other
    b_first = time.perf_counter()
    assert b_first - a_done >= TTL_S * 0.8
    assert ttft_b > TTL_S
    assert _metric(gateway, "dgw_session_waits_total") == waits0 + 1
    assert _metric(gateway, "dgw_session_proceeded_total") == 0
    assert _metric(gateway, "dgw_session_wait_seconds_sum") >= TTL_S * 0.8
    # with flow control on, each of the three rounds passed its gate too, and none is left queued there
    flow_on = request.node.callspec.params["gateway"] == "sessions-and-flow-control"
    assert _metric(gateway, "dgw_flow_wait_seconds_count") == (3 if flow_on else 0)
    assert _metric(gateway, "dgw_flow_queued_requests") == 0


@contextlib.contextmanager
def _two_replicas(redis_url: str, tmp_path: Path, shared: bool) -> Iterator[list[Gateway]]:
    """Two gateway replicas on one Redis in front of one worker whose cache holds one context."""
    profile = tmp_path / "profiles.toml"
    profile.write_text(PROFILE)
    cluster = SimCluster("unified:sm100", time_scale=1.0, extra=["--profiles", str(profile)])
    toml = f'redis.url = "{redis_url}"\nredis.timeout_s = 10\n' + SESSIONS + f"shared = {str(shared).lower()}\n"
    replicas: list[Gateway] = []
    try:
        for _ in range(2):
            replicas.append(Gateway(tmp_path, [(cluster.urls[0], "unified", "sm100")], extra_toml=toml))
            replicas[-1].wait_ready(1)
        yield replicas
    finally:
        for gw in replicas:
            gw.stop()
        cluster.stop()


def _clients(replicas: list[Gateway]) -> list[openai.AsyncOpenAI]:
    return [openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0, timeout=60) for gw in replicas]


@pytest.mark.parametrize("shared", [True, False])
async def test_replicas_on_one_redis_count_each_others_live_sessions(redis_url: str, tmp_path: Path,
                                                                     shared: bool) -> None:
    """Session a's rounds through one replica, session b's through another, one worker that holds
    one context: shared, b waits for a's TTL as it would on one gateway; each replica alone, b
    goes at once, beside a's live context (the thrash the capacity exists to prevent)."""
    with _two_replicas(redis_url, tmp_path, shared) as replicas:
        one, two = _clients(replicas)
        first = [{"role": "user", "content": _context("alpha")}]
        _, answer, prompt, _ = await _round(one, "agent-a", first)
        other = asyncio.create_task(_round(two, "agent-b", [{"role": "user", "content": _context("bravo")}]))
        await asyncio.sleep(0.3) if shared else await asyncio.wait_for(asyncio.shield(other), 10)
        assert not other.done() if shared else other.done()
        second = [*first, {"role": "assistant", "content": answer}, {"role": "user", "content": "and the tests?"}]
        _, _, _, cached2 = await _round(one, "agent-a", second)
        a_done = time.perf_counter()
        ttft_b, _, _, _ = await other
        if shared:  # a's context stayed whole; b went once a's TTL had run out
            assert cached2 >= prompt - 128
            assert time.perf_counter() - a_done >= TTL_S * 0.8
            assert _metric(replicas[1], "dgw_session_waits_total") == 1
        else:  # b went at once, beside a's live context
            assert ttft_b < TTL_S
            assert _metric(replicas[1], "dgw_session_waits_total") == 0
        assert _metric(replicas[1], "dgw_redis_errors_total") == 0


async def test_a_round_waiting_at_one_replica_goes_before_a_later_one_at_another(redis_url: str,
                                                                                 tmp_path: Path) -> None:
    """One worker that holds one context, session a live on it through replica one. b's round
    waits at replica two, then c's at replica one: when a's TTL runs out, b goes first (it has
    waited longer), though c waits at the replica that saw a end; c goes once b's TTL has run out."""
    with _two_replicas(redis_url, tmp_path, shared=True) as replicas:
        one, two = _clients(replicas)
        await _round(one, "agent-a", [{"role": "user", "content": _context("alpha")}])
        a_done = time.perf_counter()

        async def first_token_at(client: openai.AsyncOpenAI, session: str, word: str) -> float:
            await _round(client, session, [{"role": "user", "content": _context(word)}])
            return time.perf_counter()

        b = asyncio.create_task(first_token_at(two, "agent-b", "bravo"))
        await asyncio.sleep(0.4)  # b waits, and replica two has told replica one so
        c = asyncio.create_task(first_token_at(one, "agent-c", "charlie"))
        b_at, c_at = await asyncio.gather(b, c)
        assert b_at - a_done >= TTL_S * 0.8  # b waited for a's TTL
        assert c_at - b_at >= TTL_S * 0.8  # c waited for b's, though it waited where a ended
        assert _metric(replicas[0], "dgw_session_proceeded_total") == 0
        assert _metric(replicas[1], "dgw_session_proceeded_total") == 0
        assert sum(_metric(gw, "dgw_redis_errors_total") for gw in replicas) == 0


def _words(word: str, n: int) -> str:
    return " ".join(f"{word}{i}" for i in range(n))


async def _served(client: openai.AsyncOpenAI, session: str, messages: list[dict[str, str]]) -> tuple[str, int]:
    """(the worker that served it, as the x-dgw-worker header names it; cached tokens) of one round."""
    raw = await client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=4, extra_headers={"x-session-id": session})
    usage = raw.parse().usage
    details = usage.prompt_tokens_details if usage is not None else None
    return raw.headers["x-dgw-worker"], (details.cached_tokens or 0) if details is not None else 0


async def test_a_round_whose_prefix_every_worker_caches_takes_whichever_has_room_first(tmp_path: Path) -> None:
    """Two workers, each full with one live session (a shared system prompt and ~20 blocks of its
    own); a third session's round is mostly that system prompt, cached on both alike. It waits for
    room on either and starts on the one whose session's TTL runs out first: not pinned to the one
    that sorts first (it had all such rounds line up for it)."""
    profile = tmp_path / "profiles.toml"
    profile.write_text(PROFILE)
    cluster = SimCluster("unified:sm100,unified:sm100", time_scale=1.0, extra=["--profiles", str(profile)])
    try:
        gw = Gateway(tmp_path, [(url, "unified", "sm100") for url in cluster.urls], extra_toml=SESSIONS)
        try:
            gw.wait_ready(2)
            client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0, timeout=60)
            system = {"role": "system", "content": _words("shared", 1100)}  # ~20 blocks
            rounds = {s: [system, {"role": "user", "content": _words(s, 1100)}] for s in ("agent-a", "agent-b")}
            worker_of = {s: (await _served(client, s, rounds[s]))[0] for s in rounds}
            assert len(set(worker_of.values())) == 2  # the second found no room beside the first
            # The worker ids (host:port) the policy's ties sort by, as the header names them.
            ids = sorted(url.removeprefix("http://") for url in cluster.urls)
            first, last = digest_of(ids[0]), digest_of(ids[-1])
            keep = next(s for s, w in worker_of.items() if w == first)
            await asyncio.sleep(0.8)
            await _served(client, keep, rounds[keep])  # the first-sorting worker's session stays live longer
            started = time.perf_counter()
            served, cached = await _served(client, "agent-c", [system, {"role": "user", "content": "hello"}])
            waited = time.perf_counter() - started
            assert served == last  # pinned to `first`, it would have waited for `keep`'s TTL
            assert cached >= 18 * 128  # the system prompt, cached there
            assert TTL_S * 0.2 < waited < TTL_S  # it waited for room, and less than `keep`'s TTL
            assert _metric(gw, "dgw_session_waits_total") == 1
            assert _metric(gw, "dgw_session_proceeded_total") == 0
        finally:
            gw.stop()
    finally:
        cluster.stop()
