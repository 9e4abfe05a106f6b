"""PD on vLLM workers without a vLLM: the prefill/decode bodies and the hand-off handle
(gateway/upstream/vllm_pd.py), and the request path on scripted worker calls (legs.py opening the
decode leg before any token, engine pairing, a failed hand-off). The real servers run in
tests/e2e/test_vllm_pd.py."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from deepinfer_gateway.config import GatewaySettings, HealthSettings, parse_worker_spec
from deepinfer_gateway.core import protocol as wp
from deepinfer_gateway.core.errors import UpstreamError, UpstreamFailed, UpstreamKind
from deepinfer_gateway.gateway.fleet.client_ids import client_worker_id
from deepinfer_gateway.gateway.fleet.registry import WorkerRegistry
from deepinfer_gateway.gateway.serving.server import RequestServer
from deepinfer_gateway.gateway.telemetry.metrics import GatewayMetrics
from deepinfer_gateway.gateway.upstream import vllm_pd
from deepinfer_gateway.gateway.upstream.base import LegRequest
from deepinfer_gateway.gateway.upstream.vllm import completion_body
from deepinfer_gateway.kvcache.factory import create_prefix_index
from deepinfer_gateway.recipe_bridge.encoder import PromptEncoder
from deepinfer_gateway.recipe_bridge.prepare import BridgeConfig, RequestPreparer
from deepinfer_gateway.recipe_bridge.tokenizer import load_tokenizer
from deepinfer_gateway.router.inflight import MemoryInflight
from deepinfer_gateway.router.planner import RoutePlanner
from tests.unit.test_request_server import MODEL, Script, ScriptedClient, prepared_chat

FORMAT = "vllm:tiny:128"
NIXL_PARAMS = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[3, 4]],
               "remote_engine_id": "e-1", "remote_host": "10.0.0.5", "remote_port": 5600,
               "remote_request_id": "cmpl-req-1-0", "tp_size": 1}


def vllm_answer(transfer: dict[str, Any] | None, finish: str = "length") -> dict[str, Any]:
    return {"id": "cmpl-1", "object": "text_completion", "model": "tiny",
            "choices": [{"index": 0, "text": "x", "token_ids": [42], "finish_reason": finish}],
            "usage": {"prompt_tokens": 300, "completion_tokens": 1, "total_tokens": 301,
                      "prompt_tokens_details": {"cached_tokens": 128}},
            "kv_transfer_params": transfer}


def test_prefill_body_asks_for_a_remote_decode_and_drops_what_the_discarded_token_needs() -> None:
    base = completion_body("tiny", [1, 2, 3], {"temperature": 0.0, "logprobs": True, "top_logprobs": 2,
                                               "so_args": {"schema_type": "regex", "schema": "a+"}}, 50)
    body = vllm_pd.prefill_body(base)
    assert body["max_tokens"] == 1 and body["stream"] is False and body["prompt"] == [1, 2, 3]
    assert body["kv_transfer_params"] == vllm_pd.PREFILL_TRANSFER_PARAMS
    assert body["kv_transfer_params"] is not vllm_pd.PREFILL_TRANSFER_PARAMS  # a copy per request
    for gone in ("stream_options", "structured_outputs", "logprobs", "return_tokens_as_token_ids"):
        assert gone not in body
    assert base["stream"] is True and base["max_tokens"] == 50  # the base body is left alone


def test_priority_goes_to_vllm_only_when_set_and_to_a_worker_protocol_worker_only_if_it_schedules_by_it() -> None:
    assert "priority" not in completion_body("tiny", [1], {}, 5)
    assert completion_body("tiny", [1], {}, 5, priority=-1)["priority"] == -1
    leg = LegRequest("r", [1, 2], {}, priority=1)
    assert "priority" not in leg.wire() and leg.wire(by_priority=True)["priority"] == 1
    assert "priority" not in LegRequest("r", [1, 2], {}).wire(by_priority=True)  # 0: the engines' default
    entry = {"url": "http://127.0.0.1:1", "engine": "vllm", "id": "v", "hardware": "sm100"}
    assert parse_worker_spec(entry).scheduling_policy == "fcfs"
    assert parse_worker_spec({**entry, "scheduling_policy": "priority"}).scheduling_policy == "priority"
    with pytest.raises(ValueError):
        parse_worker_spec({**entry, "scheduling_policy": "lifo"})


def test_prefill_answer_becomes_ready_and_a_hand_off_carrying_the_transfer_params() -> None:
    ready, finish = vllm_pd.prefill_events(vllm_answer(NIXL_PARAMS), "vllm-p", FORMAT)
    assert ready == wp.ready_event(300, 128, 0)
    assert finish["event"] == "finish" and finish["reason"] == "stop"
    handoff = finish["kv_handoff"]
    assert handoff["source_worker"] == "vllm-p" and handoff["kv_format"] == FORMAT and handoff["num_tokens"] == 300
    assert vllm_pd.transfer_of(handoff) == NIXL_PARAMS
    decode = vllm_pd.decode_body({"prompt": [1, 2, 3], "stream": True}, vllm_pd.transfer_of(handoff))
    assert decode == {"prompt": [1, 2, 3], "stream": True, "kv_transfer_params": NIXL_PARAMS}


def test_connectors_without_transfer_params_hand_off_an_empty_handle() -> None:
    """ExampleConnector (and others keyed by the prompt's tokens) answer kv_transfer_params: null."""
    _ready, finish = vllm_pd.prefill_events(vllm_answer(None), "vllm-p", FORMAT)
    assert finish["kv_handoff"]["handle"] == ""
    assert vllm_pd.transfer_of(finish["kv_handoff"]) is None
    assert "kv_transfer_params" not in vllm_pd.decode_body({"prompt": [1]}, None)


def test_an_aborted_prefill_is_an_abort_not_a_hand_off() -> None:
    _ready, finish = vllm_pd.prefill_events(vllm_answer(None, finish="abort"), "vllm-p", FORMAT)
    assert finish["reason"] == "abort" and "kv_handoff" not in finish


@pytest.mark.parametrize("answer", [{}, {"choices": [], "usage": {}}, {"choices": [{}], "usage": {"x": 1}},
                                    vllm_answer([1, 2]), "text"])
def test_malformed_prefill_answers_are_refused(answer: Any) -> None:
    with pytest.raises(ValueError):
        vllm_pd.prefill_events(answer, "vllm-p", FORMAT)


@pytest.mark.parametrize("handle", ["not json", "[1, 2]", "7"])
def test_a_handle_from_another_engine_is_refused(handle: str) -> None:
    with pytest.raises(ValueError, match="vLLM prefill"):
        vllm_pd.transfer_of({"handle": handle})


# --- the request path on scripted calls ---------------------------------------------------


class RecordingClient(ScriptedClient):
    """ScriptedClient that also records each call's body, and accepts vLLM registrations."""

    def __init__(self, scripts: dict[str, list[Script]]):
        super().__init__(scripts)
        self.bodies: list[tuple[str, LegRequest]] = []

    async def generate(self, url: str, leg: LegRequest) -> Any:
        self.bodies.append((url, leg))
        return await super().generate(url, leg)


PREFILL, DECODE, SIM_DECODE = "http://vllm-p.test", "http://vllm-d.test", "http://sim-d.test"


class PdRig:
    """A prefill worker at PREFILL and decode workers at the other URLs, all of one KV format."""

    def __init__(self, scripts: dict[str, list[Script]], engines: dict[str, str]):
        # no PD bypass: the short test prompt would otherwise run whole on a decode worker
        self.settings = GatewaySettings.model_validate({"max_attempts": 2, "router": {"pd_bypass_tokens": 0}})
        self.metrics = GatewayMetrics()
        self.client = RecordingClient(scripts)
        specs = tuple(parse_worker_spec({"url": u, "role": wp.Role.PREFILL if u == PREFILL else wp.Role.DECODE,
                                        "engine": engines[u]}) for u in scripts)
        self.registry = WorkerRegistry(specs, self.client, HealthSettings(), self.metrics)
        for w in self.registry.workers.values():
            w.healthy = True
            w.info = wp.WorkerInfo(worker_id=w.worker_id, engine="vllm" if engines[w.url] == "vllm" else "sim",
                                   role=w.spec.role, hardware=wp.Hardware.SM100, kv_format=FORMAT, model=MODEL,
                                   epoch="e1")
        self.server = RequestServer(self.registry, RoutePlanner(self.settings.router),
                                    create_prefix_index(None), MemoryInflight(), load_tokenizer(None), self.metrics,
                                    self.settings)

    def worker(self, url: str) -> Any:
        return next(w for w in self.registry.workers.values() if w.url == url)

    def samples(self, histogram: Any, pool: str) -> float:
        return sum(s.value for m in histogram.collect() for s in m.samples
                   if s.name.endswith("_count") and s.labels.get("pool") == pool)

    def assert_released(self) -> None:
        assert self.metrics.inflight._value.get() == 0
        assert all(w.inflight == 0 for w in self.registry.workers.values())


def prefill_script() -> Script:
    return vllm_pd.prefill_events(vllm_answer(NIXL_PARAMS), "vllm-p.test", FORMAT)  # PREFILL's worker id


def decode_script(tokens: int = 3) -> Script:
    return [wp.ready_event(300, 0, 0), *(wp.tokens_event([200 + i]) for i in range(tokens)),
            wp.finish_event(wp.FinishReason.LENGTH, num_output_tokens=tokens)]


@pytest.fixture(scope="module")
def preparer() -> RequestPreparer:
    return RequestPreparer(PromptEncoder(load_tokenizer(None)), BridgeConfig())


async def test_a_prefill_handing_off_before_a_token_answers_with_the_decode_workers_tokens(
        preparer: RequestPreparer) -> None:
    rig = PdRig({PREFILL: [prefill_script()], DECODE: [decode_script(3)]}, {PREFILL: "vllm", DECODE: "vllm"})
    prepared = prepared_chat(preparer)
    response = await rig.server.serve(prepared, "req-1", 0.0)
    reply = orjson.loads(response.body)
    assert reply["usage"]["prompt_tokens"] == 300  # the prefill's counts
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == 128
    assert reply["usage"]["completion_tokens"] == 3  # the decode's tokens, the prefill's discarded
    # the plan's first leg, as for sim PD
    assert response.headers["x-dgw-worker"] == client_worker_id(rig.worker(PREFILL).spec)
    (p_url, p_leg), (d_url, d_leg) = rig.client.bodies
    assert (p_url, p_leg.role) == (PREFILL, "prefill")
    assert (d_url, d_leg.role) == (DECODE, "decode")
    assert d_leg.token_ids == prepared.token_ids  # the prefill's prompt, unchanged
    assert d_leg.kv_handoff is not None and vllm_pd.transfer_of(d_leg.kv_handoff) == NIXL_PARAMS
    # TTFT and queue time on the prefill pool; duration and output length on the decode pool
    assert rig.samples(rig.metrics.ttft, "prefill") == 1 and rig.samples(rig.metrics.ttft, "decode") == 0
    assert rig.samples(rig.metrics.queue_time, "prefill") == 1
    assert rig.samples(rig.metrics.duration, "decode") == 1 and rig.samples(rig.metrics.duration, "prefill") == 0
    rig.assert_released()
    assert rig.client.aborted == []  # both workers finished their legs


async def test_a_vllm_prefill_never_hands_off_to_another_engines_decode(preparer: RequestPreparer) -> None:
    """A sim decode worker with the same KV format, and less loaded, is passed over."""
    rig = PdRig({PREFILL: [prefill_script()], SIM_DECODE: [decode_script(2)], DECODE: [decode_script(2)]},
                {PREFILL: "vllm", SIM_DECODE: "dgw", DECODE: "vllm"})
    assert rig.worker(PREFILL).worker_id == "vllm-p.test"  # the hand-off's source_worker (prefill_script)
    rig.worker(DECODE).inflight = 5
    views = await rig.server.routing.views()
    chosen, _ = rig.server.planner.plan_decode(views, FORMAT, 10)
    assert chosen.worker_id == rig.worker(SIM_DECODE).worker_id  # the planner alone would pick the sim worker
    await rig.server.serve(prepared_chat(preparer), "req-1", 0.0)
    assert [url for url, _ in rig.client.bodies] == [PREFILL, DECODE]
    rig.worker(DECODE).inflight -= 5
    rig.assert_released()


async def test_no_decode_worker_of_the_engine_is_a_502_with_every_leg_released(preparer: RequestPreparer) -> None:
    rig = PdRig({PREFILL: [prefill_script()], SIM_DECODE: [decode_script(2)]},
                {PREFILL: "vllm", SIM_DECODE: "dgw"})
    with pytest.raises(UpstreamFailed, match="no decode worker took the hand-off"):
        await rig.server.serve(prepared_chat(preparer), "req-1", 0.0)
    assert [url for url, _ in rig.client.bodies] == [PREFILL]
    rig.assert_released()


async def test_a_failing_decode_worker_is_retried_on_another(preparer: RequestPreparer) -> None:
    other = "http://vllm-d2.test"
    refused = UpstreamError(UpstreamKind.CONNECT, "cannot reach")
    rig = PdRig({PREFILL: [prefill_script()], DECODE: [refused], other: [decode_script(2)]},
                {PREFILL: "vllm", DECODE: "vllm", other: "vllm"})
    rig.worker(other).inflight = 1  # the planner tries DECODE first
    response = await rig.server.serve(prepared_chat(preparer), "req-1", 0.0)
    assert orjson.loads(response.body)["usage"]["completion_tokens"] == 2
    assert [url for url, _ in rig.client.bodies] == [PREFILL, DECODE, other]
    assert rig.metrics.retries.labels("connect")._value.get() == 1
    rig.worker(other).inflight -= 1
    rig.assert_released()
