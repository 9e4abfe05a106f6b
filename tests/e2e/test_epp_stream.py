"""The EPP driven over its real ext_proc gRPC stream (tests/epp_stream.py) against real sim
workers: stateful policies decide each request once (the pick observed, its fallbacks only
ranked), only the client APIs are routed, and the subset hint comes from the data plane."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.launch import Epp, SimCluster, free_port
from tests.e2e.test_epp_envoy import wait_ready
from tests.epp_stream import SUBSET, ExtProcClient
from tests.fault_doubles import scrape, total

pytestmark = pytest.mark.timeout(300)

MODEL = "DeepSeek-V4.1-Flash"


def chat(text: str) -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 8}


class Picker:
    def __init__(self, epp: Epp):
        self.epp = epp
        self.client = ExtProcClient(epp.grpc_port)


@pytest.fixture(scope="module")
def cluster() -> Iterator[SimCluster]:
    cluster = SimCluster("unified:sm100,unified:sm100,unified:sm100", time_scale=50)
    try:
        yield cluster
    finally:
        cluster.stop()


def endpoints(cluster: SimCluster) -> list[str]:
    return [u.split("//", 1)[1] for u in cluster.urls]


def start(tmp: Path, cluster: SimCluster, policy: str, *, subset_hint_header: bool = False) -> Epp:
    epp = Epp(tmp, [(u, "unified", "sm100") for u in cluster.urls], fallbacks=2,
              extra_toml=f'[router]\npolicy = "{policy}"\nsession_affinity = true\n',
              subset_hint_header=subset_hint_header)
    try:
        wait_ready(epp)
    except BaseException:
        epp.stop()
        raise
    return epp


@pytest.fixture(scope="module")
def round_robin(cluster: SimCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Picker]:
    epp = start(tmp_path_factory.mktemp("epp-rr"), cluster, "round_robin")
    picker = Picker(epp)
    try:
        yield picker
    finally:
        picker.client.close()
        epp.stop()


@pytest.fixture(scope="module")
def prefix_approx(cluster: SimCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Picker]:
    epp = start(tmp_path_factory.mktemp("epp-pa"), cluster, "prefix_approx", subset_hint_header=True)
    picker = Picker(epp)
    try:
        yield picker
    finally:
        picker.client.close()
        epp.stop()


def test_round_robin_spreads_nine_requests_three_per_worker(round_robin: Picker, cluster: SimCluster) -> None:
    answers = [round_robin.client.request("/v1/chat/completions", chat(f"Question {i}?")) for i in range(9)]
    assert Counter(a.endpoints[0] for a in answers) == {e: 3 for e in endpoints(cluster)}
    for answer in answers:  # the pick, then the other two as fallbacks
        assert sorted(answer.endpoints) == sorted(endpoints(cluster))


def test_a_session_stays_on_its_worker(round_robin: Picker) -> None:
    session = {"x-session-id": "alice"}
    alice, others = [], []
    for i in range(4):
        alice.append(round_robin.client.request("/v1/chat/completions", chat(f"Turn {i}"), headers=session))
        others.append(round_robin.client.request("/v1/chat/completions", chat(f"Someone else {i}")))
    assert len({a.endpoints[0] for a in alice}) == 1
    assert len({a.endpoints[0] for a in others}) > 1  # round robin still turns for everyone else


def test_prefix_approx_credits_its_history_to_the_pick(prefix_approx: Picker) -> None:
    prefix = "You are a careful assistant answering questions about routing history. " * 40
    first = prefix_approx.client.request("/v1/chat/completions", chat(prefix + "First?"))
    second = prefix_approx.client.request("/v1/chat/completions", chat(prefix + "Second?"))
    assert second.endpoints[0] == first.endpoints[0]
    assert first.endpoints[-1] != first.endpoints[0]  # fallbacks were listed, and not remembered


@pytest.mark.parametrize(("method", "path", "status"), [
    ("GET", "/v1/worker/kv_events", 404),
    ("POST", "/v1/worker/generate", 404),
    ("POST", "/v1/worker/abort", 404),
    ("GET", "/v1/worker/info", 404),
    ("GET", "/load", 404),
    ("GET", "/info", 404),
    ("GET", "/metrics", 404),
    ("GET", "/v1/responses/resp_1", 404),
    ("POST", "/v1/chat/completions/../../v1/worker/generate", 404),
    ("GET", "/v1/chat/completions", 405),
])
def test_anything_but_a_client_api_is_refused_at_the_headers(round_robin: Picker, method: str, path: str,
                                                             status: int) -> None:
    answer = round_robin.client.request(path, method=method)
    assert answer.status == status and answer.endpoints == []
    assert answer.body is not None and "error" in answer.body
    if status == 405:
        assert answer.headers is not None and answer.headers["allow"] == "POST"
    assert total(scrape(round_robin.epp.url), "dgw_inflight_requests") == 0


def test_the_client_apis_are_routed(round_robin: Picker) -> None:
    assert round_robin.client.request("/v1/models", method="GET").endpoints
    messages = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]}
    assert round_robin.client.request("/v1/messages?beta=true", messages).endpoints
    assert round_robin.client.request("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 4}).endpoints


def test_a_client_subset_header_pins_nothing_by_default(round_robin: Picker, cluster: SimCluster) -> None:
    gone = f"127.0.0.1:{free_port()}"
    answers = [round_robin.client.request("/v1/chat/completions", chat("Pin me"), headers={SUBSET: e})
               for e in [gone, *endpoints(cluster)]]
    assert all(a.status is None for a in answers)  # routed, where the header would leave no endpoint
    assert len({a.endpoints[0] for a in answers}) > 1  # round robin's turns, not the header's endpoint
    only = endpoints(cluster)[1]
    for _ in range(3):  # the data plane's metadata is the subset hint
        assert round_robin.client.request("/v1/chat/completions", chat("Pinned"),
                                          subset_metadata=[only]).endpoints == [only]


def test_a_subset_header_counts_where_the_deployment_allows_it(prefix_approx: Picker, cluster: SimCluster) -> None:
    only = endpoints(cluster)[2]
    for i in range(3):
        answer = prefix_approx.client.request("/v1/chat/completions", chat(f"Pinned {i}"), headers={SUBSET: only})
        assert answer.endpoints == [only]
    gone = prefix_approx.client.request("/v1/chat/completions", chat("Gone"),
                                        headers={SUBSET: f"127.0.0.1:{free_port()}"})
    assert gone.status == 503
