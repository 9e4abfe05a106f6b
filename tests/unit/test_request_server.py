"""RequestServer on scripted worker calls: retries, refusals, the stream/drain outcomes, and
that every leg's lease is released whichever way the request ends.

`ScriptedClient` stands in for the upstream seam (gateway/upstream/base.py): each worker URL has
a list of event scripts, one per generate call; an exception in a script is raised from that
read. Everything else (registry, planner, in-memory index and reservations,
tokenizer, response building, metrics) is the real thing.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest
from starlette.requests import ClientDisconnect

from deepinfer_gateway.config import DgwWorkerSpec, GatewaySettings, HealthSettings
from deepinfer_gateway.core import protocol as wp
from deepinfer_gateway.core.errors import NoHealthyWorker, UpstreamError, UpstreamFailed, UpstreamKind, WorkerRefused
from deepinfer_gateway.gateway.fleet.client_ids import digest_of
from deepinfer_gateway.gateway.fleet.registry import WorkerRegistry
from deepinfer_gateway.gateway.serving.relay import MAX_COALESCED_BYTES, RelayResponse
from deepinfer_gateway.gateway.serving.server import RequestServer
from deepinfer_gateway.gateway.telemetry.metrics import GatewayMetrics
from deepinfer_gateway.gateway.upstream.base import LegRequest
from deepinfer_gateway.kvcache.factory import create_prefix_index
from deepinfer_gateway.recipe_bridge.encoder import PromptEncoder
from deepinfer_gateway.recipe_bridge.prepare import ApiProtocol, BridgeConfig, PreparedRequest, RequestPreparer
from deepinfer_gateway.recipe_bridge.tokenizer import load_tokenizer
from deepinfer_gateway.router.inflight import MemoryInflight
from deepinfer_gateway.router.planner import RoutePlanner

MODEL = "DeepSeek-V4.1-Flash"
Script = list[Any]  # events (dicts), or an exception to raise at that read


def ok_script(tokens: int = 3) -> Script:
    return [wp.ready_event(10, 0, 0), *(wp.tokens_event([100 + i]) for i in range(tokens)),
            wp.finish_event(wp.FinishReason.LENGTH, num_output_tokens=tokens)]


class ScriptedStream:
    def __init__(self, script: Script):
        self.script = list(script)
        self.closed = False

    async def next_event(self) -> dict[str, Any] | None:
        await asyncio.sleep(0)
        if not self.script:
            return None
        item = self.script.pop(0)
        if isinstance(item, BaseException):
            raise item
        return dict(item)

    def buffered(self) -> bool:
        return False  # every chunk is written before the next read (coalescing: test_relay_coalescing.py)

    def close(self) -> None:
        self.closed = True


class ScriptedUpstream:
    """One worker's `Upstream` (gateway/upstream/base.py) on its client's scripts."""

    def __init__(self, client: ScriptedClient, spec: Any):
        self.spec = spec
        self.handoff_family = str(spec.engine)
        self.reports_queue = False
        self._client = client

    async def generate(self, leg: LegRequest) -> ScriptedStream:
        return await self._client.generate(self.spec.url, leg)

    async def abort(self, request_id: str) -> None:
        self._client.aborted.append((self.spec.url, request_id))

    def retire(self) -> None:
        self._client.retired.append(self.spec.url)


class ScriptedClient:
    def __init__(self, scripts: dict[str, list[Script]], stream_type: type[ScriptedStream] = ScriptedStream):
        self.scripts = scripts
        self.stream_type = stream_type
        self.streams: list[ScriptedStream] = []
        self.aborted: list[tuple[str, str]] = []
        self.retired: list[str] = []  # workers whose upstream the registry retired
        self.legs: list[LegRequest] = []  # every leg asked for, in order

    def upstream(self, spec: Any) -> Any:
        return ScriptedUpstream(self, spec)

    async def generate(self, url: str, leg: LegRequest) -> ScriptedStream:
        self.legs.append(leg)
        await asyncio.sleep(0)
        script = self.scripts[url].pop(0)
        if isinstance(script, UpstreamError):
            raise script
        stream = self.stream_type(script)
        self.streams.append(stream)
        return stream


URLS = ("http://w1.test", "http://w2.test")


@pytest.fixture(scope="module")
def preparer() -> RequestPreparer:
    return RequestPreparer(PromptEncoder(load_tokenizer(None)), BridgeConfig())


def prepared_chat(preparer: RequestPreparer, *, stream: bool = False) -> PreparedRequest:
    body = {"model": MODEL, "max_tokens": 8, "stream": stream, "messages": [{"role": "user", "content": "Hi"}]}
    return preparer.prepare(ApiProtocol.CHAT, orjson.dumps(body))


class Rig:
    def __init__(self, scripts: dict[str, list[Script]], max_attempts: int = 2,
                 stream_type: type[ScriptedStream] = ScriptedStream):
        self.settings = GatewaySettings(max_attempts=max_attempts)
        self.metrics = GatewayMetrics()
        self.client = ScriptedClient(scripts, stream_type)
        specs = tuple(DgwWorkerSpec(url=u) for u in scripts)
        self.registry = WorkerRegistry(specs, self.client, HealthSettings(), self.metrics)
        for w in self.registry.workers.values():
            w.healthy = True
            w.info = wp.WorkerInfo(worker_id=w.worker_id, engine="sim", role=wp.Role.UNIFIED,
                                   hardware=wp.Hardware.SM100, kv_format="fp8", model=MODEL, epoch="e1")
        self.done: list[int] = []
        self.server = RequestServer(self.registry, RoutePlanner(self.settings.router),
                                    create_prefix_index(None), MemoryInflight(), load_tokenizer(None), self.metrics,
                                    self.settings)

    async def serve(self, prepared: PreparedRequest) -> Any:
        return await self.server.serve(prepared, "req-1", 0.0, on_done=self.done.append)

    def gauge(self) -> float:
        return self.metrics.inflight._value.get()

    def requests(self, status: str) -> float:
        return self.metrics.requests.labels("chat", MODEL, status)._value.get()

    def assert_released(self) -> None:
        assert self.gauge() == 0
        assert all(w.inflight == 0 for w in self.registry.workers.values())
        assert all(s.closed for s in self.client.streams)


async def test_non_streamed_answer(preparer: RequestPreparer) -> None:
    rig = Rig({URLS[0]: [ok_script(3)]})
    response = await rig.serve(prepared_chat(preparer))
    assert response.status_code == 200 and response.headers["x-dgw-worker"] == digest_of("w1.test")  # no address
    assert orjson.loads(response.body)["choices"][0]["finish_reason"] == "length"
    assert rig.requests("200") == 1 and rig.done == [3]
    rig.assert_released()
    assert rig.client.aborted == []  # the worker finished: nothing to abort


async def test_a_malformed_ready_releases_the_leg(preparer: RequestPreparer) -> None:
    """A `ready` without its cached-token counts fails after the call opened: an unexpected
    exception (the app answers 500), and the worker call must still be released."""
    bad_ready = [{"event": "ready", "prompt_tokens": 10}, wp.tokens_event([1])]
    rig = Rig({URLS[0]: [bad_ready]})
    with pytest.raises(KeyError):
        await rig.serve(prepared_chat(preparer))
    await asyncio.sleep(0)
    rig.assert_released()
    assert rig.done == [0]
    assert rig.client.aborted == [(URLS[0], rig.client.legs[0].request_id)]  # the gateway's id, not "req-1"


async def test_retry_on_another_worker_before_the_first_token(preparer: RequestPreparer) -> None:
    refused = UpstreamError(UpstreamKind.CONNECT, "cannot reach")
    rig = Rig({URLS[0]: [refused, refused], URLS[1]: [ok_script(2), ok_script(2)]})
    for _ in range(2):  # whichever worker the policy tries first, the request is served
        assert (await rig.serve(prepared_chat(preparer))).status_code == 200
    rig.assert_released()
    assert rig.metrics.retries.labels("connect")._value.get() >= 1


async def test_every_attempt_failing_is_upstream_failed(preparer: RequestPreparer) -> None:
    broken = [wp.ready_event(10, 0, 0), UpstreamError(UpstreamKind.DISCONNECT, "lost")]
    rig = Rig({URLS[0]: [broken], URLS[1]: [broken]})
    with pytest.raises(UpstreamFailed, match="All 2 attempted workers failed"):
        await rig.serve(prepared_chat(preparer))
    rig.assert_released()
    assert rig.done == []  # no request reached its first token


async def test_a_workers_refusal_answers_with_its_status_and_message(preparer: RequestPreparer) -> None:
    refusal = [wp.finish_event(wp.FinishReason.ERROR, error_kind=wp.ErrorKind.PROMPT_TOO_LONG, message="too long")]
    rig = Rig({URLS[0]: [refusal]})
    with pytest.raises(WorkerRefused) as info:
        await rig.serve(prepared_chat(preparer))
    assert (info.value.status_code, info.value.message) == (400, "too long")
    rig.assert_released()


async def test_no_healthy_worker(preparer: RequestPreparer) -> None:
    rig = Rig({URLS[0]: []})
    rig.registry.workers["w1.test"].healthy = False
    with pytest.raises(NoHealthyWorker):
        await rig.serve(prepared_chat(preparer))


async def test_a_failure_mid_answer_is_upstream_failed_and_releases(preparer: RequestPreparer) -> None:
    script = [wp.ready_event(10, 0, 0), wp.tokens_event([1]), UpstreamError(UpstreamKind.DISCONNECT, "lost")]
    rig = Rig({URLS[0]: [script]})
    with pytest.raises(UpstreamFailed, match="mid-answer"):
        await rig.serve(prepared_chat(preparer))
    await asyncio.sleep(0)
    rig.assert_released()
    assert rig.requests("200") == 0  # the app counts the error it answers
    assert rig.client.aborted == [(URLS[0], rig.client.legs[0].request_id)]  # the gateway's id, not "req-1"


async def _run_stream(response: RelayResponse, *, disconnect_after: int | None = None) -> list[bytes]:
    sent: list[bytes] = []

    async def receive() -> dict[str, Any]:
        await asyncio.Event().wait()
        return {}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body" and message.get("body"):
            sent.append(message["body"])
            if disconnect_after is not None and len(sent) >= disconnect_after:
                raise OSError("client went away")

    scope = {"type": "http", "asgi": {"spec_version": "2.4"}, "method": "POST", "path": "/"}
    try:
        await response(scope, receive, send)
    except ClientDisconnect:  # Starlette's word for the OSError send raised
        pass
    return sent


async def test_streamed_answer_and_mid_stream_failure(preparer: RequestPreparer) -> None:
    failing = [wp.ready_event(10, 0, 0), wp.tokens_event([1]), UpstreamError(UpstreamKind.DISCONNECT, "lost")]
    rig = Rig({URLS[0]: [ok_script(3), failing]}, max_attempts=1)
    response = await rig.serve(prepared_chat(preparer, stream=True))
    assert isinstance(response, RelayResponse) and rig.gauge() == 1
    frames = b"".join(await _run_stream(response))
    assert b"[DONE]" in frames and rig.requests("200") == 1
    response = await rig.serve(prepared_chat(preparer, stream=True))
    frames = b"".join(await _run_stream(response))
    assert b"The worker failed mid-stream" in frames and rig.requests("502") == 1
    assert rig.metrics.upstream_errors.labels("w1.test", "disconnect")._value.get() == 1
    rig.assert_released()
    assert rig.done == [3, 1]


async def test_a_client_leaving_mid_stream_is_499_and_aborts(preparer: RequestPreparer) -> None:
    rig = Rig({URLS[0]: [ok_script(6)]})
    response = await rig.serve(prepared_chat(preparer, stream=True))
    await _run_stream(response, disconnect_after=1)
    await asyncio.sleep(0)
    assert rig.requests("499") == 1 and rig.metrics.client_disconnects._value.get() == 1
    rig.assert_released()
    assert rig.client.aborted == [(URLS[0], rig.client.legs[0].request_id)]  # the gateway's id, not "req-1"


class ArrivingStream(ScriptedStream):
    """A worker whose events arrive over time, as a real connection's would: a read that finds
    nothing arrived waits for the next one; `arrive(n)` is time passing elsewhere (a slow
    client's write) while n more arrive. `buffered` is True only for an arrived event."""

    def __init__(self, script: Script):
        super().__init__(script)
        self.arrived = 1  # `ready`, read before the relay starts
        self.read = 0

    def arrive(self, n: int) -> None:
        self.arrived += n

    async def next_event(self) -> dict[str, Any] | None:
        if self.read >= self.arrived:
            self.arrived += 1
        self.read += 1
        return await super().next_event()

    def buffered(self) -> bool:
        return bool(self.script) and self.read < self.arrived


def content_of(raw: bytes) -> str:
    return "".join(orjson.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                   for line in raw.split(b"\n") if line.startswith(b"data: {") and b'"choices":[{' in line)


def words_script(steps: int) -> Script:
    """A `ready`, `steps` one-word `tokens` events of answer text, a `finish`."""
    bundle = load_tokenizer(None)
    ids = [bundle.tokenizer.encode(f" word{i}") for i in range(steps)]
    return [wp.ready_event(10, 0, 0), wp.tokens_event(bundle.tokenizer.encode("</think>")),
            *(wp.tokens_event(step) for step in ids), wp.finish_event(wp.FinishReason.LENGTH)]


async def test_a_lagging_client_gets_the_steps_sent_meanwhile_in_one_write(preparer: RequestPreparer) -> None:
    """While a write waits for a slow client, the events that arrive are coalesced: the next
    write carries all of them, and the client's answer is the same as a prompt client's."""
    script = words_script(60)
    body = {"model": MODEL, "max_tokens": 500, "stream": True, "messages": [{"role": "user", "content": "Hi"}]}
    runs: dict[str, list[bytes]] = {}
    for name, lagging in (("prompt", False), ("lagging", True)):
        rig = Rig({URLS[0]: [list(script)]}, stream_type=ArrivingStream)
        response = await rig.serve(preparer.prepare(ApiProtocol.CHAT, orjson.dumps(body)))
        sent: list[bytes] = []

        async def send(message: dict[str, Any], lagging: bool = lagging, sent: list[bytes] = sent,
                       stream: ScriptedStream = rig.client.streams[-1]) -> None:
            if message["type"] == "http.response.body" and message.get("body"):
                sent.append(message["body"])
                if lagging and len(sent) % 10 == 2:  # every tenth write waits for the client...
                    assert isinstance(stream, ArrivingStream)
                    stream.arrive(12)  # ...while 12 more steps arrive

        async def receive() -> dict[str, Any]:
            await asyncio.Event().wait()
            return {}

        await response({"type": "http", "asgi": {"spec_version": "2.4"}, "method": "POST", "path": "/"},
                       receive, send)
        rig.assert_released()
        runs[name] = sent
    words = "".join(f" word{i}" for i in range(60))
    assert content_of(b"".join(runs["prompt"])) == content_of(b"".join(runs["lagging"])) == words
    # A prompt client gets one write per step (the head carries the first one)...
    assert [w.count(b'"content":" word') for w in runs["prompt"]] == [0] + [1] * 60 + [0]
    # ...a lagging one, after each wait, the 12 steps that arrived meanwhile in one write.
    lagged = [w.count(b'"content":" word') for w in runs["lagging"]]
    assert lagged == [0, 1] + ([12] + [1] * 9) * 2 + [12] + [1] * 5 + [0]


async def test_a_worker_that_stays_ahead_is_still_written_every_16_kib(preparer: RequestPreparer) -> None:
    """Every event already in hand: coalescing, bounded by MAX_COALESCED_BYTES per write."""
    script = words_script(400)

    class InHand(ScriptedStream):
        def buffered(self) -> bool:
            return bool(self.script)

    rig = Rig({URLS[0]: [script]}, stream_type=InHand)
    body = {"model": MODEL, "max_tokens": 500, "stream": True, "messages": [{"role": "user", "content": "Hi"}]}
    response = await rig.serve(preparer.prepare(ApiProtocol.CHAT, orjson.dumps(body)))
    sent = await _run_stream(response)
    assert content_of(b"".join(sent)) == "".join(f" word{i}" for i in range(400))
    body_writes = sent[1:]  # the head (role chunk and first token) goes out on its own
    assert len(body_writes) >= 3
    assert all(MAX_COALESCED_BYTES <= len(w) < MAX_COALESCED_BYTES + 1024 for w in body_writes[:-1])
