"""Faults: nothing lost when workers misbehave (killed mid-stream, hanging, garbage, reset).

For every case: the gateway stays up, every request ends with a complete answer or an
explicit protocol error (never a silent truncation), no engine request is leaked (the
live workers' load reports return to running == waiting == 0) and the metrics count
each outcome. Real processes on loopback only; each test is bounded to a few seconds.

The hang, garbage and reset faults run over both worker protocols: `protocol` "v1" sets the
gateway to v1, "v2" gives it a double that serves the v2 connection (the gateway's default
then uses it), and each such test checks which protocol carried the calls.
"""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from harness.launch import CLI, Gateway, Proc, free_port, wait_for_port
from tests.fault_doubles import (
    PROTOCOLS,
    FaultyWorker,
    Outcome,
    scrape,
    stream_chat,
    total,
    wait_idle,
)

MODEL = "DeepSeek-V4.1-Flash"
# Small timeouts so a hanging worker costs the test ~1 s, not the 30/120 s production defaults.
FAST_TIMEOUTS = "first_event_timeout_s = 1.0\nbetween_events_timeout_s = 1.0\nmax_attempts = 3\n"
GATEWAY_PROTOCOL = {"v1": 'worker_protocol = "v1"\n', "v2": 'worker_protocol = "auto"\n'}


def body(i: int, max_tokens: int = 16, **extra: object) -> dict[str, object]:
    return {"model": MODEL, "max_tokens": max_tokens, "thinking": {"type": "disabled"},
            "messages": [{"role": "user", "content": f"fault test question {i}"}], **extra}


class SimWorker:
    """A real `worker --engine sim` process (killable)."""

    def __init__(self, time_scale: float, hardware: str = "sm100"):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.hardware = hardware
        self.proc = Proc(CLI + ["worker", "--engine", "sim", "--hardware", hardware, "--port", str(self.port),
                                "--time-scale", str(time_scale)])
        wait_for_port(self.port, timeout=30)

    def spec(self) -> tuple[str, str, str]:
        return (self.url, "unified", self.hardware)

    def load(self) -> dict[str, object]:
        import json

        with urllib.request.urlopen(self.url + "/v1/worker/load", timeout=5) as r:
            return dict(json.load(r))

    def stop(self) -> None:
        self.proc.kill()


@pytest.fixture
def procs() -> Iterator[list[object]]:
    """Everything a test starts goes here and is killed at the end, pass or fail."""
    started: list[object] = []
    yield started
    for p in reversed(started):
        p.stop()  # type: ignore[attr-defined]


def start_gateway(tmp_path: Path, procs: list[object], workers: list[object], extra: str = FAST_TIMEOUTS,
                  protocol: str = "v2") -> Gateway:
    gw = Gateway(tmp_path, [w.spec() for w in workers],  # type: ignore[attr-defined]
                 extra_toml=extra + GATEWAY_PROTOCOL[protocol])
    procs.append(gw)
    gw.wait_ready(len(workers))
    return gw


def gateway_alive(gw: Gateway) -> bool:
    with urllib.request.urlopen(gw.url + "/health", timeout=5) as r:
        return r.status == 200


async def run_streams(gw: Gateway, bodies: list[dict[str, object]]) -> list[Outcome]:
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        return list(await asyncio.gather(*(stream_chat(session, gw.url, b) for b in bodies)))


async def run_plain(gw: Gateway, bodies: list[dict[str, object]]) -> list[tuple[int, dict[str, object]]]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        async def one(b: dict[str, object]) -> tuple[int, dict[str, object]]:
            async with session.post(gw.url + "/v1/chat/completions", json=b) as r:
                return r.status, await r.json(content_type=None)

        return list(await asyncio.gather(*(one(b) for b in bodies)))


def assert_carried_by(protocol: str, *doubles: FaultyWorker) -> None:
    """Every generate call the doubles received came over `protocol` (and there were some)."""
    for double in doubles:
        via = {call["via"] for call in double.seen()}
        assert via == {protocol}, (double.mode, via)


def assert_explicit_end(outcomes: list[Outcome]) -> None:
    """Every stream ended with [DONE] or an error frame, or never started (an HTTP error status)."""
    kinds = [o.kind for o in outcomes]
    assert "truncated" not in kinds, kinds


# --- a worker killed mid-stream ---------------------------------------------------------------


async def test_worker_killed_mid_stream(tmp_path: Path, procs: list[object]) -> None:
    victim, survivor = SimWorker(time_scale=2.0), SimWorker(time_scale=20.0, hardware="ascend950")
    procs += [victim, survivor]
    gw = start_gateway(tmp_path, procs, [victim, survivor])
    n = 8
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        tasks = [asyncio.create_task(stream_chat(session, gw.url, body(i, 600, ignore_eos=True))) for i in range(n)]
        # Kill the slow worker once the gateway has streams open on it (load report says so).
        for _ in range(200):
            if victim.load()["running"] > 0:
                break
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.3)
        victim.proc.kill()
        outcomes = await asyncio.gather(*tasks)
    assert_explicit_end(outcomes)
    failed = [o for o in outcomes if o.kind == "error"]
    assert failed, "some streams were on the killed worker"
    assert all(o.frames[-1]["error"]["message"] for o in failed)
    assert all(o.kind == "done" for o in outcomes if o not in failed)
    assert gateway_alive(gw)
    # After the kill the gateway keeps serving from the survivor.
    after = await run_streams(gw, [body(100 + i) for i in range(4)])
    assert [o.kind for o in after] == ["done"] * 4
    assert wait_idle([survivor])[0]["running"] == 0
    m = scrape(gw.url)
    assert total(m, "dgw_requests_total", status="502") == len(failed)
    assert total(m, "dgw_requests_total", status="200") == n - len(failed) + 4
    assert total(m, "dgw_upstream_errors_total", worker=victim.url.split("://")[1]) >= len(failed)
    assert total(m, "dgw_inflight_requests") == 0


# --- a worker that hangs ------------------------------------------------------------------------


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_hanging_engine_before_ready_is_retried_elsewhere(tmp_path: Path, procs: list[object],
                                                               protocol: str) -> None:
    """A wedged sim engine (accepts, never steps): first_event_timeout_s, retry, and the engine request freed."""
    hung, good = FaultyWorker("sim-hang"), FaultyWorker("ok", protocol=protocol)
    procs += [hung, good]
    gw = start_gateway(tmp_path, procs, [hung, good], protocol=protocol)
    outcomes = await run_streams(gw, [body(i) for i in range(4)])
    assert [o.kind for o in outcomes] == ["done"] * 4
    assert_carried_by(protocol, good)
    loads = wait_idle([hung, good])
    assert all(x["running"] == 0 and x["waiting"] == 0 for x in loads), loads
    m = scrape(gw.url)
    hung_id = hung.url.split("://")[1]
    assert total(m, "dgw_retries_total", reason="timeout") == total(m, "dgw_upstream_errors_total", worker=hung_id,
                                                                    kind="timeout")
    assert total(m, "dgw_requests_total", status="200") == 4
    assert gateway_alive(gw)


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_hanging_worker_alone_gives_an_explicit_error(tmp_path: Path, procs: list[object], protocol: str) -> None:
    hung = FaultyWorker("hang-before-ready", protocol=protocol)
    procs.append(hung)
    gw = start_gateway(tmp_path, procs, [hung], extra=FAST_TIMEOUTS.replace("max_attempts = 3", "max_attempts = 1"),
                       protocol=protocol)
    results = await run_plain(gw, [body(i) for i in range(3)])
    assert all(status in (502, 503, 504) and payload["error"]["message"] for status, payload in results), results
    assert_carried_by(protocol, hung)
    assert wait_idle([hung])[0]["running"] == 0
    m = scrape(gw.url)
    assert total(m, "dgw_upstream_errors_total", kind="timeout") == 3
    assert sum(total(m, "dgw_requests_total", status=str(s)) for s in (502, 503, 504)) == 3
    assert gateway_alive(gw)


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_worker_hanging_mid_stream_ends_with_an_error_event(tmp_path: Path, procs: list[object],
                                                                  protocol: str) -> None:
    hung = FaultyWorker("hang-after", after=3, protocol=protocol)
    procs.append(hung)
    gw = start_gateway(tmp_path, procs, [hung], protocol=protocol)
    outcomes = await run_streams(gw, [body(i) for i in range(4)])
    assert [o.kind for o in outcomes] == ["error"] * 4
    assert_carried_by(protocol, hung)
    assert all(o.text.strip() for o in outcomes)  # the tokens before the hang did arrive
    assert wait_idle([hung])[0]["running"] == 0  # the gateway hung up on the worker
    m = scrape(gw.url)
    assert total(m, "dgw_upstream_errors_total", kind="timeout") == 4
    assert total(m, "dgw_requests_total", status="502") == 4
    assert gateway_alive(gw)


# --- a worker that returns garbage -------------------------------------------------------------


@pytest.mark.parametrize(("mode", "protocol"), [("garbage-before", "v1"), ("garbage-before", "v2"), ("html", "v1"),
                                               ("http-500", "v1")])
async def test_garbage_before_the_first_token_is_retried(tmp_path: Path, procs: list[object], mode: str,
                                                         protocol: str) -> None:
    bad, good = FaultyWorker(mode, protocol=protocol), FaultyWorker("ok", protocol=protocol)
    procs += [bad, good]
    gw = start_gateway(tmp_path, procs, [bad, good], protocol=protocol)
    outcomes = await run_streams(gw, [body(i) for i in range(6)])
    assert [o.kind for o in outcomes] == ["done"] * 6
    assert_carried_by(protocol, bad, good)
    calls_to_bad = len(bad.seen())
    m = scrape(gw.url)
    bad_id = bad.url.split("://")[1]
    assert total(m, "dgw_upstream_errors_total", worker=bad_id) == calls_to_bad
    assert total(m, "dgw_retries_total") == calls_to_bad
    assert total(m, "dgw_requests_total", status="200") == 6
    assert [x["running"] for x in wait_idle([bad, good])] == [0, 0]
    assert gateway_alive(gw)


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("mode", ["garbage-after", "reset-after"])
async def test_garbage_or_reset_mid_stream_ends_with_an_error_event(tmp_path: Path, procs: list[object],
                                                                    mode: str, protocol: str) -> None:
    bad = FaultyWorker(mode, after=3, protocol=protocol)
    procs.append(bad)
    gw = start_gateway(tmp_path, procs, [bad], protocol=protocol)
    outcomes = await run_streams(gw, [body(i) for i in range(4)])
    assert_carried_by(protocol, bad)
    # A reset can reach the gateway before it has read the first token (socket buffering): then it
    # is a pre-stream failure, retried, and with no other worker an HTTP 502. Both are explicit.
    assert all(o.kind == "error" or (o.kind == "http_error" and o.status == 502) for o in outcomes), outcomes
    assert any(o.kind == "error" for o in outcomes)
    m = scrape(gw.url)
    assert total(m, "dgw_requests_total", status="502") == 4
    assert total(m, "dgw_upstream_errors_total") >= 4
    plain = await run_plain(gw, [body(10)])  # non-streaming: an error status, not a cut answer
    assert plain[0][0] in (502, 503) and plain[0][1]["error"]["message"]
    assert wait_idle([bad])[0]["running"] == 0
    assert gateway_alive(gw)


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_non_streaming_failure_mid_answer_is_counted_once(tmp_path: Path, procs: list[object],
                                                                protocol: str) -> None:
    bad = FaultyWorker("garbage-after", after=3, protocol=protocol)
    procs.append(bad)
    gw = start_gateway(tmp_path, procs, [bad], protocol=protocol)
    plain = await run_plain(gw, [body(i) for i in range(3)])
    assert all(status == 502 for status, _ in plain)
    assert_carried_by(protocol, bad)
    assert total(scrape(gw.url), "dgw_requests_total") == 3


async def test_request_id_comes_back_and_the_worker_gets_ids_of_ours(tmp_path: Path, procs: list[object]) -> None:
    """The client's x-request-id is echoed; the worker gets a fresh id of the gateway's (a client's
    id is not unique: two requests with the same one would collide on the worker)."""
    good = FaultyWorker("ok", tokens=2)
    procs.append(good)
    gw = start_gateway(tmp_path, procs, [good])
    async with aiohttp.ClientSession() as session:
        async with session.post(gw.url + "/v1/chat/completions", json=body(1),
                                headers={"x-request-id": "trace-me-123"}) as r:
            assert r.status == 200 and r.headers["x-request-id"] == "trace-me-123"
        async with session.post(gw.url + "/v1/chat/completions", json=body(2)) as r:
            generated = r.headers["x-request-id"]
            assert len(generated) >= 16
    seen = good.seen()
    assert [s["request_id"] for s in seen] == [s["body_request_id"] for s in seen]
    worker_ids = {s["request_id"] for s in seen}
    assert len(worker_ids) == 2 and not worker_ids & {"trace-me-123", generated}
