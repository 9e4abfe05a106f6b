"""Background Responses through the real openai SDK and gateway: `background: true` answered
queued at once and polled to its end with `retrieve`, `cancel` (the engine request aborted on
the worker), a streamed background response resumed with `starting_after`, per-key scope, and
what a gateway stop or crash leaves (docs/api.md): with Redis, read from another gateway.

The workers run in real time (time_scale 1), so a long answer is still running when the test
cancels or resumes it."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from deepinfer_gateway.infra.redis_process import RedisProcess
from harness.launch import Gateway, SimCluster
from tests.e2e.test_conversations import _key_toml

MODEL = "deepseek-chat"
LONG = {"max_output_tokens": 3000, "extra_body": {"ignore_eos": True}}  # runs for many seconds in real time


@pytest.fixture(scope="module")
def slow_cluster() -> Iterator[SimCluster]:
    cluster = SimCluster("unified:sm100", time_scale=1.0)
    yield cluster
    cluster.stop()


def _gateway(cluster: SimCluster, tmp: Path, toml: str = "") -> Gateway:
    roles = [spec.split(":") for spec in cluster.specs]
    gateway = Gateway(tmp, [(url, role, hw) for url, (role, hw) in zip(cluster.urls, roles, strict=True)],
                      extra_toml=toml)
    gateway.wait_ready(len(roles))
    return gateway


@pytest.fixture(scope="module")
def gateway(slow_cluster: SimCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    gw = _gateway(slow_cluster, tmp_path_factory.mktemp("gw"), _key_toml("alice", "bob"))
    yield gw
    gw.stop()


def _client(gateway: Gateway, key: str = "sk-alice") -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0, timeout=60)


def _running(cluster: SimCluster) -> int:
    total = 0
    for url in cluster.urls:
        with urllib.request.urlopen(url + "/v1/worker/load", timeout=5) as answer:
            load = json.load(answer)
        total += load["running"] + load["waiting"]
    return total


def _until(check: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        found = check()
        if found:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout}s")
        time.sleep(0.05)


def _metric(gateway: Gateway, series: str) -> float:
    text = httpx.get(gateway.url + "/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(series))


def test_a_background_response_is_queued_then_polled_to_its_end(gateway: Gateway) -> None:
    client = _client(gateway)
    started = time.monotonic()
    queued = client.responses.create(model=MODEL, input="in the background", background=True,
                                     max_output_tokens=40, extra_body={"ignore_eos": True},
                                     include=["message.output_text.logprobs"], top_logprobs=2)
    assert time.monotonic() - started < 1.0  # answered before the answer was generated
    assert queued.status == "queued" and queued.background is True and queued.output == []
    assert queued.top_logprobs == 2  # what it asked, echoed from the start as when done
    done = _until(lambda: (r := client.responses.retrieve(queued.id)).status not in ("queued", "in_progress") and r,
                  30, "completion")
    assert done.status == "incomplete" and done.background is True and done.id == queued.id
    assert done.output_text and done.usage is not None and done.usage.output_tokens == 40
    assert done.top_logprobs == 2
    shown = client.responses.retrieve(queued.id, include=["message.output_text.logprobs"])
    (message,) = [item for item in shown.output if item.type == "message"]
    assert len(message.content[0].logprobs) == 40 and len(message.content[0].logprobs[0].top_logprobs) == 2
    assert [i.role for i in client.responses.input_items.list(queued.id).data] == ["user"]
    # It continues like any stored response.
    follow = client.responses.create(model=MODEL, input="and?", previous_response_id=queued.id, max_output_tokens=2)
    assert follow.usage is not None and follow.usage.input_tokens > done.usage.input_tokens + 40
    with pytest.raises(openai.BadRequestError):  # finished: nothing to cancel
        client.responses.cancel(queued.id)
    with pytest.raises(openai.NotFoundError):  # another key's
        _client(gateway, "sk-bob").responses.retrieve(queued.id)
    assert _metric(gateway, 'dgw_background_responses_total{outcome="incomplete"}') >= 1


def test_a_background_response_in_a_conversation_is_appended_once_it_ends(gateway: Gateway) -> None:
    client = _client(gateway)
    conv = client.conversations.create(items=[{"role": "user", "content": "Before."}])
    queued = client.responses.create(model=MODEL, input="In the background.", conversation=conv.id, background=True,
                                     max_output_tokens=300, extra_body={"ignore_eos": True})
    assert queued.conversation is not None and queued.conversation.id == conv.id
    with pytest.raises(openai.BadRequestError) as running:  # its answer is not there yet
        client.responses.create(model=MODEL, input="x", previous_response_id=queued.id, max_output_tokens=2)
    assert running.value.body["param"] == "previous_response_id"
    done = _until(lambda: (r := client.responses.retrieve(queued.id)).status not in ("queued", "in_progress") and r,
                  30, "completion")
    texts = [i.content[0].text for i in client.conversations.items.list(conv.id, order="asc").data]
    assert texts == ["Before.", "In the background.", done.output_text]


def test_cancel_stops_a_running_background_response_and_its_engine_request(
        gateway: Gateway, slow_cluster: SimCluster) -> None:
    client = _client(gateway)
    running = client.responses.create(model=MODEL, input="a long one", background=True, **LONG)
    _until(lambda: client.responses.retrieve(running.id).status == "in_progress", 20, "in progress")
    assert _running(slow_cluster) == 1
    with pytest.raises(openai.NotFoundError):
        _client(gateway, "sk-bob").responses.cancel(running.id)  # another key's: not found
    cancelled = client.responses.cancel(running.id)
    assert cancelled.status == "cancelled" and cancelled.id == running.id
    _until(lambda: _running(slow_cluster) == 0, 2, "the worker's request aborted")
    time.sleep(0.5)
    assert client.responses.retrieve(running.id).status == "cancelled"  # the run wrote nothing after
    assert client.responses.cancel(running.id).status == "cancelled"  # again: the same answer
    with pytest.raises(openai.BadRequestError):  # not a background response
        client.responses.cancel(client.responses.create(model=MODEL, input="x", max_output_tokens=2).id)
    assert _metric(gateway, 'dgw_background_responses_total{outcome="cancelled"}') >= 1


def test_a_streamed_background_response_resumes_after_a_sequence_number(gateway: Gateway) -> None:
    client = _client(gateway)
    seen: list[Any] = []
    with client.responses.create(model=MODEL, input="stream in the background", background=True, stream=True,
                                 max_output_tokens=400, extra_body={"ignore_eos": True}) as stream:
        for event in stream:
            seen.append(event)
            if event.type == "response.output_text.delta" and len(seen) >= 6:
                break  # the client goes away mid-answer; the response runs on
    assert seen[0].type == "response.created" and seen[0].response.status == "queued"
    assert seen[0].response.background is True
    assert [e.sequence_number for e in seen] == list(range(len(seen)))
    response_id, last = seen[0].response.id, seen[-1].sequence_number
    assert client.responses.retrieve(response_id).status == "in_progress"  # resumed live, below

    resumed = list(client.responses.retrieve(response_id, stream=True, starting_after=last))
    assert [e.sequence_number for e in resumed] == list(range(last + 1, last + 1 + len(resumed)))
    final = resumed[-1]
    assert final.type == "response.incomplete" and final.response.background is True
    deltas = "".join(e.delta for e in seen + resumed if e.type == "response.output_text.delta")
    assert deltas == final.response.output_text == client.responses.retrieve(response_id).output_text
    # Once ended, the whole stream replays from the start.
    replayed = list(client.responses.retrieve(response_id, stream=True))
    assert [e.sequence_number for e in replayed] == list(range(last + 1 + len(resumed)))

    polled = client.responses.create(model=MODEL, input="x", background=True, max_output_tokens=2)
    for bad in ({"stream": True, "starting_after": -5}, {"starting_after": 3}):
        with pytest.raises(openai.BadRequestError):
            client.responses.retrieve(response_id, **bad)
    with pytest.raises(openai.BadRequestError):  # created without stream: nothing to replay
        list(client.responses.retrieve(polled.id, stream=True))


def test_background_state_outlives_its_gateway_as_documented(slow_cluster: SimCluster, redis_server: RedisProcess,
                                                             tmp_path: Path) -> None:
    toml = f'redis.url = "{redis_server.url}"\n' + _key_toml("alice")
    first = _gateway(slow_cluster, tmp_path, toml)
    second = _gateway(slow_cluster, tmp_path, toml)  # a replica on the same Redis
    started = [first, second]
    try:
        a, b = _client(first), _client(second)
        # Cancelled on another replica: the running one learns it within a second and aborts.
        running = a.responses.create(model=MODEL, input="cancel me elsewhere", background=True, **LONG)
        _until(lambda: b.responses.retrieve(running.id).status == "in_progress", 20, "in progress")
        assert b.responses.cancel(running.id).status == "cancelled"
        _until(lambda: _running(slow_cluster) == 0, 3, "the worker's request aborted")
        # Streamed on one replica, resumed on the other while it runs.
        with a.responses.create(model=MODEL, input="follow me", background=True, stream=True,
                                max_output_tokens=100, extra_body={"ignore_eos": True}) as stream:
            head = [next(iter(stream)) for _ in range(3)]
        tail = list(b.responses.retrieve(head[0].response.id, stream=True, starting_after=2))
        assert tail[0].sequence_number == 3 and tail[-1].type == "response.incomplete"

        # A gateway stopped (SIGTERM): its runs end failed at once, the engine requests aborted.
        stopped = a.responses.create(model=MODEL, input="stop", background=True, **LONG)
        _until(lambda: b.responses.retrieve(stopped.id).status == "in_progress", 20, "in progress")
        first.stop()
        failed = b.responses.retrieve(stopped.id)
        assert failed.status == "failed" and failed.error is not None and "stopped" in failed.error.message
        _until(lambda: _running(slow_cluster) == 0, 3, "the worker's request aborted")

        # A gateway that dies (SIGKILL) cannot say so: after STALE_S unheard, a read fails it.
        third = _gateway(slow_cluster, tmp_path, toml)
        started.append(third)
        crashed = _client(third).responses.create(model=MODEL, input="crash", background=True, **LONG)
        _until(lambda: b.responses.retrieve(crashed.id).status == "in_progress", 20, "in progress")
        third.proc.kill()
        assert b.responses.retrieve(crashed.id).status == "in_progress"
        time.sleep(10.5)
        lost = b.responses.retrieve(crashed.id)
        assert lost.status == "failed" and lost.error is not None
    finally:
        for gw in started:
            gw.stop()


def test_background_responses_survive_a_redis_crash_on_the_shipped_config(slow_cluster: SimCluster,
                                                                         tmp_path: Path) -> None:
    data = tmp_path / "redis-data"
    data.mkdir()
    server = RedisProcess(config_file=Path(__file__).parents[2] / "deploy" / "k8s" / "redis.conf", data_dir=data)
    server.start()
    gateway = _gateway(slow_cluster, tmp_path, f'redis.url = "{server.url}"\n')
    try:
        client = _client(gateway, "test")
        with client.responses.create(model=MODEL, input="keep my stream", background=True, stream=True,
                                     max_output_tokens=20, extra_body={"ignore_eos": True}) as stream:
            streamed = list(stream)
        response_id = streamed[0].response.id
        assert streamed[-1].type == "response.incomplete"
        time.sleep(1.5)  # the shipped appendfsync everysec: a write older than a second is on disk
        server.stop()  # SIGKILL
        server.start()  # the same data directory, as the StatefulSet's volume
        kept = client.responses.retrieve(response_id)
        assert kept.status == "incomplete" and kept.output_text == streamed[-1].response.output_text
        replayed = list(client.responses.retrieve(response_id, stream=True, starting_after=0))
        assert [e.model_dump() for e in replayed] == [e.model_dump() for e in streamed[1:]]
    finally:
        gateway.stop()
        server.stop()


@pytest.mark.parametrize("backend", ["redis", "redis-cluster"])
async def test_a_background_runs_state_is_compare_and_set_and_deleted_with_its_response(
        backend: str, request: pytest.FixtureRequest) -> None:
    # No TTL (the shipped volatile-lru evicts only keys with one); on a cluster every key the
    # scripts touch is in the stored responses' one slot.
    import uuid

    from deepinfer_gateway.gateway.serving.background_store import RedisBackgroundStore
    from deepinfer_gateway.gateway.serving.response_store import (
        BYTES_KEY,
        Quota,
        RedisResponseStore,
        StoredResponse,
        owner_hash,
    )
    from deepinfer_gateway.infra.redis_conn import redis_client
    from tests.conftest import redis_backend_url

    client = redis_client(redis_backend_url(request, backend), cluster=backend == "redis-cluster")
    responses = RedisResponseStore(client, Quota(ttl_s=600, max_per_key=10, max_bytes=2048, max_bytes_per_key=8192,
                                                 max_total_bytes=10**9))
    store = RedisBackgroundStore(responses)
    owner = f"key:{uuid.uuid4().hex}"
    digest = owner_hash(owner)
    try:
        queued = StoredResponse({"id": "resp_1", "status": "queued"}, [])
        await store.start(owner, "resp_1", queued)
        assert await store.advance(owner, "resp_1", events=(b"e0", b"e1")) == "queued"
        running = StoredResponse({"id": "resp_1", "status": "in_progress"}, [])
        assert await store.advance(owner, "resp_1", state="in_progress", stored=running) == "in_progress"
        assert await store.advance(owner, "resp_1", state="cancelled") == "cancelled"
        # Terminal: the runner's last write does not change it.
        assert await store.advance(owner, "resp_1", state="completed", events=(b"e2",)) == "cancelled"
        run = await store.run_state(owner, "resp_1")
        assert run is not None and run.state == "cancelled" and run.events == 2
        assert await store.events(owner, "resp_1", 1, 2) == [b"e1"]
        assert int(await client.hget(BYTES_KEY, digest)) == len(running.dumps()) + 4
        ttls = [await client.ttl(k) async for k in client.scan_iter(match=f"{{dgw:resp}}:*{digest}*")]
        assert len(ttls) >= 4 and all(ttl == -1 for ttl in ttls)
        assert await store.advance(owner, "resp_2", events=(b"x",)) == "gone"  # unknown
        await store.start(owner, "resp_2", queued)
        assert await store.advance(owner, "resp_2", events=(b"x" * 4096,)) == "full"  # past max_bytes
        assert await responses.delete(owner, "resp_1") and await responses.delete(owner, "resp_2")
        assert not [k async for k in client.scan_iter(match=f"{{dgw:resp}}:*{digest}*")]  # run state and events too
        assert int(await client.hget(BYTES_KEY, digest)) == 0
        assert await store.advance(owner, "resp_1") == "gone"
    finally:
        await client.aclose()


@pytest.mark.parametrize("backend", ["memory", "redis"])
async def test_a_write_past_the_bounds_is_refused_and_the_record_kept(backend: str,
                                                                     request: pytest.FixtureRequest) -> None:
    import uuid

    from deepinfer_gateway.gateway.serving.background_store import (
        BackgroundStore,
        MemoryBackgroundStore,
        RedisBackgroundStore,
    )
    from deepinfer_gateway.gateway.serving.response_store import (
        MemoryResponseStore,
        Quota,
        RedisResponseStore,
        StoredResponse,
    )
    from deepinfer_gateway.infra.redis_conn import redis_client
    from tests.conftest import redis_backend_url

    quota = Quota(ttl_s=600, max_per_key=10, max_bytes=2048, max_bytes_per_key=3000, max_total_bytes=10**9)
    client = None
    store: BackgroundStore
    if backend == "memory":
        store = MemoryBackgroundStore(MemoryResponseStore(quota))
    else:
        client = redis_client(redis_backend_url(request, backend))
        store = RedisBackgroundStore(RedisResponseStore(client, quota))
    owner = f"key:{uuid.uuid4().hex}"
    try:
        queued = StoredResponse({"id": "resp_1", "status": "queued"}, [])
        await store.start(owner, "resp_1", queued)
        await store.start(owner, "resp_2", StoredResponse({"id": "resp_2", "pad": "x" * 1500}, []))
        big = StoredResponse({"id": "resp_1", "status": "in_progress", "pad": "x" * 1500}, [])
        assert await store.advance(owner, "resp_1", state="in_progress", stored=big) == "full"  # the key's bytes
        assert await store.advance(owner, "resp_1", events=(b"x" * 2100,)) == "full"  # the response's max_bytes
        kept = await store.record(owner, "resp_1")
        assert kept is not None and kept.response == queued.response
        run = await store.run_state(owner, "resp_1")
        assert run is not None and run.state == "queued" and run.events == 0
        assert await store.advance(owner, "resp_1", state="failed", stored=queued) == "failed"
        assert await store.advance(owner, "resp_1", state="cancelled") == "failed"  # terminal stays
    finally:
        if client is not None:
            await client.aclose()
