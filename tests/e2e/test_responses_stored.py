"""Stored Responses through the real openai SDK and gateway: store, previous_response_id,
retrieve / delete / input_items, per-key scope (the key or its tenant, never its name), refused
fields, the count and byte bounds, restart with Redis, and a Redis outage."""

from __future__ import annotations

import hashlib
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis as redis_lib

from deepinfer_gateway.infra.redis_process import RedisProcess
from deepinfer_gateway.workload.synthesis import PromptSynthesizer
from deepinfer_gateway.workload.types import TraceRequest
from harness.launch import Gateway, SimCluster

MODEL = "deepseek-chat"  # without thinking: the whole answer is part of the follow-up's prompt


def _client(gateway: Gateway, key: str = "test") -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0, timeout=60)


def _long_text(index: int, tokens: int = 700) -> str:
    return PromptSynthesizer.for_default_tokenizer().content(TraceRequest(index, 0.0, tokens, 1))


def test_a_stored_response_is_retrieved_listed_continued_and_deleted(sim_gateway: Gateway) -> None:
    client = _client(sim_gateway)
    first = client.responses.create(model=MODEL, input=_long_text(901), max_output_tokens=200,
                                    extra_body={"ignore_eos": True})
    assert client.responses.retrieve(first.id).model_dump() == first.model_dump()
    items = client.responses.input_items.list(first.id)
    assert [item.type for item in items.data] == ["message"] and items.data[0].role == "user"
    assert items.data[0].id

    follow = client.responses.create(model=MODEL, input="and then?", previous_response_id=first.id,
                                     max_output_tokens=8)
    assert follow.usage is not None and first.usage is not None
    # The stored conversation came first: the prompt holds the first input and its answer,
    # and the worker that holds them served them from its cache.
    assert follow.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert follow.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 128
    listed = client.responses.input_items.list(follow.id, order="asc")
    assert [i.type for i in listed.data] == ["message", "message", "message"]
    assert [i.role for i in listed.data] == ["user", "assistant", "user"]
    assert listed.data[1].content[0].text == first.output_text

    deleted = client.responses.with_raw_response.delete(first.id)
    assert deleted.http_response.json() == {"id": first.id, "object": "response.deleted", "deleted": True}
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as unknown:
        client.responses.create(model=MODEL, input="hi", previous_response_id=first.id, max_output_tokens=2)
    assert unknown.value.body["param"] == "previous_response_id"


def test_a_streamed_response_is_stored_before_its_last_event(sim_gateway: Gateway) -> None:
    client = _client(sim_gateway)
    final = None
    for event in client.responses.create(model=MODEL, input="stream me", max_output_tokens=8, stream=True):
        if event.type in ("response.completed", "response.incomplete"):
            # The client holds the final event: the response is already retrievable.
            assert client.responses.retrieve(event.response.id).id == event.response.id
            final = event.response
        if event.type in ("response.created", "response.in_progress", "response.completed", "response.incomplete"):
            assert _says_stored(event.response) is True, event.type  # as the JSON answer says
    assert final is not None
    assert client.responses.retrieve(final.id).output_text == final.output_text


def test_store_false_and_unsupported_fields(sim_gateway: Gateway) -> None:
    client = _client(sim_gateway)
    unstored = client.responses.create(model=MODEL, input="hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.BadRequestError) as refused:  # a background response is read from the store
        client.responses.create(model=MODEL, input="hi", max_output_tokens=2, store=False, background=True)
    assert refused.value.body["param"] == "background"
    with pytest.raises(openai.NotFoundError) as unknown:
        client.responses.create(model=MODEL, input="hi", max_output_tokens=2, conversation="conv_123")
    assert unknown.value.body["param"] == "conversation"
    stored = client.responses.create(model=MODEL, input="x", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.responses.input_items.list(stored.id, limit=500)


def _key_toml(*names: str) -> str:
    lines = []
    for name in names:
        digest = hashlib.sha256(f"sk-{name}".encode()).hexdigest()
        lines += ["[[api_keys]]", f'name = "{name}"', f'key_sha256 = "{digest}"', ""]
    return "\n".join(lines)


@pytest.fixture
def keyed_redis_gateway(sim_cluster: SimCluster, redis_server: RedisProcess,
                        tmp_path: Path) -> Iterator[tuple[Gateway, Path]]:
    roles = [spec.split(":") for spec in sim_cluster.specs]
    workers = [(url, role, hw) for url, (role, hw) in zip(sim_cluster.urls, roles, strict=True)]
    toml = f'redis.url = "{redis_server.url}"\n[responses]\nmax_per_key = 3\n' + _key_toml("alice", "bob")
    gateway = Gateway(tmp_path, workers, extra_toml=toml.replace("[responses]", "\n[responses]"))
    gateway.wait_ready(len(workers))
    yield gateway, tmp_path
    gateway.stop()


def test_responses_are_per_key_bounded_and_survive_a_gateway_restart(
        keyed_redis_gateway: tuple[Gateway, Path], sim_cluster: SimCluster, redis_server: RedisProcess) -> None:
    gateway, tmp = keyed_redis_gateway
    alice, bob = _client(gateway, "sk-alice"), _client(gateway, "sk-bob")
    kept = alice.responses.create(model=MODEL, input="mine", max_output_tokens=4)
    with pytest.raises(openai.NotFoundError):
        bob.responses.retrieve(kept.id)  # another key's response does not exist for it
    with pytest.raises(openai.NotFoundError):
        bob.responses.create(model=MODEL, input="x", previous_response_id=kept.id, max_output_tokens=2)
    alice.responses.create(model=MODEL, input="two", max_output_tokens=2)
    alice.responses.create(model=MODEL, input="three", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError) as full:
        alice.responses.create(model=MODEL, input="four", max_output_tokens=2)
    assert full.value.body["code"] == "stored_responses_limit"
    alice.responses.create(model=MODEL, input="four", max_output_tokens=2, store=False)  # still served

    gateway.stop()  # a new gateway process on the same Redis
    roles = [spec.split(":") for spec in sim_cluster.specs]
    workers = [(url, role, hw) for url, (role, hw) in zip(sim_cluster.urls, roles, strict=True)]
    again = Gateway(tmp, workers, extra_toml=f'redis.url = "{redis_server.url}"\n' + _key_toml("alice", "bob"))
    try:
        again.wait_ready(len(workers))
        assert _client(again, "sk-alice").responses.retrieve(kept.id).output_text == kept.output_text
    finally:
        again.stop()


def test_an_openai_agents_sdk_agent_continues_by_previous_response_id(sim_gateway: Gateway) -> None:
    import asyncio

    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, set_tracing_disabled

    set_tracing_disabled(True)  # no export to OpenAI's tracing service

    async def run() -> tuple[str, str]:
        client = openai.AsyncOpenAI(base_url=sim_gateway.url + "/v1", api_key="test", max_retries=0)
        agent = Agent(name="assistant", instructions="Answer briefly.",
                      model=OpenAIResponsesModel(model=MODEL, openai_client=client),
                      model_settings=ModelSettings(max_tokens=1024))  # the sim answers and stops
        first = await Runner.run(agent, "What is a KV cache?")
        second = await Runner.run(agent, "Say it again, shorter.", previous_response_id=first.last_response_id)
        assert first.last_response_id and second.last_response_id
        await client.close()
        return first.last_response_id, second.last_response_id

    first_id, second_id = asyncio.run(run())
    client = _client(sim_gateway)
    texts = [item.content[0].text for item in client.responses.input_items.list(second_id, order="asc").data]
    # The second turn's input is the first turn's question, its answer, then the new question.
    assert texts[0] == "What is a KV cache?" and texts[-1] == "Say it again, shorter."
    assert texts[1] == client.responses.retrieve(first_id).output_text


def test_a_stored_response_survives_a_redis_crash_on_the_shipped_config(sim_cluster: SimCluster,
                                                                       tmp_path: Path) -> None:
    import time

    shipped = Path(__file__).parents[2] / "deploy" / "k8s" / "redis.conf"
    data = tmp_path / "redis-data"
    data.mkdir()
    server = RedisProcess(config_file=shipped, data_dir=data)
    server.start()
    roles = [spec.split(":") for spec in sim_cluster.specs]
    workers = [(url, role, hw) for url, (role, hw) in zip(sim_cluster.urls, roles, strict=True)]
    gateway = Gateway(tmp_path, workers, extra_toml=f'redis.url = "{server.url}"\n')
    try:
        gateway.wait_ready(len(workers))
        kept = _client(gateway).responses.create(model=MODEL, input="remember me", max_output_tokens=4)
        time.sleep(1.5)  # the shipped appendfsync everysec: a write older than a second is on disk
        server.stop()  # SIGKILL
        server.start()  # the same data directory, as the StatefulSet's volume
        follow = _client(gateway).responses.create(model=MODEL, input="and now?", previous_response_id=kept.id,
                                                   max_output_tokens=4)
        assert _client(gateway).responses.retrieve(kept.id).output_text == kept.output_text
        items = _client(gateway).responses.input_items.list(follow.id, order="asc").data
        assert items[0].content[0].text == "remember me"
    finally:
        gateway.stop()
        server.stop()


# --------------------------------------------------------------------------- whose responses they are
def _says_stored(response: Any) -> bool:
    """The response object's `store` (the SDK's Response model does not declare it)."""
    return bool(response.model_dump()["store"])


def _redis_keyed_gateway(sim_cluster: SimCluster, redis: RedisProcess, tmp: Path, toml: str = "",
                         stderr: Any = None) -> Gateway:
    roles = [spec.split(":") for spec in sim_cluster.specs]
    workers = [(url, role, hw) for url, (role, hw) in zip(sim_cluster.urls, roles, strict=True)]
    gateway = Gateway(tmp, workers, extra_toml=f'redis.url = "{redis.url}"\n' + toml, stderr=stderr)
    gateway.wait_ready(len(workers))
    return gateway


def _store_redis_key(redis: RedisProcess, key: str, **fields: str) -> None:
    client = redis_lib.Redis.from_url(redis.url)
    try:
        client.hset(f"dgw:apikey:{hashlib.sha256(key.encode()).hexdigest()}", mapping=fields)
    finally:
        client.close()


def test_keys_of_one_name_share_nothing_and_keys_of_one_tenant_share_their_responses(
        sim_cluster: SimCluster, redis_server: RedisProcess, tmp_path: Path) -> None:
    # Keys in Redis are not checked against each other's names: two keys named alike must still
    # be two owners (responses and rate-limit buckets), while keys naming one tenant are one.
    _store_redis_key(redis_server, "sk-one", name="team")
    _store_redis_key(redis_server, "sk-two", name="team")
    _store_redis_key(redis_server, "sk-limited-1", name="limited", requests_per_minute="1")
    _store_redis_key(redis_server, "sk-limited-2", name="limited", requests_per_minute="1")
    _store_redis_key(redis_server, "sk-acme-1", name="acme-old", tenant="acme")
    _store_redis_key(redis_server, "sk-acme-2", name="acme-new", tenant="acme")
    gateway = _redis_keyed_gateway(sim_cluster, redis_server, tmp_path, "api_keys_in_redis = true\n")
    try:
        one, two = _client(gateway, "sk-one"), _client(gateway, "sk-two")
        mine = one.responses.create(model=MODEL, input="mine", max_output_tokens=2)
        with pytest.raises(openai.NotFoundError):
            two.responses.retrieve(mine.id)
        with pytest.raises(openai.NotFoundError):
            two.responses.input_items.list(mine.id)
        with pytest.raises(openai.NotFoundError):
            two.responses.create(model=MODEL, input="x", previous_response_id=mine.id, max_output_tokens=2)
        with pytest.raises(openai.NotFoundError):
            two.responses.delete(mine.id)
        # One request a minute each: the other key's request did not spend this one's.
        limited = [_client(gateway, f"sk-limited-{n}") for n in (1, 2)]
        for client in limited:
            client.responses.create(model=MODEL, input="x", max_output_tokens=2, store=False)
        for client in limited:
            with pytest.raises(openai.RateLimitError):
                client.responses.create(model=MODEL, input="again", max_output_tokens=2, store=False)

        old, new = _client(gateway, "sk-acme-1"), _client(gateway, "sk-acme-2")
        before = old.responses.create(model=MODEL, input="before the rotation", max_output_tokens=2)
        assert new.responses.retrieve(before.id).id == before.id  # one tenant, rotating its key
        with pytest.raises(openai.NotFoundError):
            one.responses.retrieve(before.id)
    finally:
        gateway.stop()


# --------------------------------------------------------------------------- bounds
def test_a_keys_bytes_and_the_total_bound_what_is_stored(sim_cluster: SimCluster, redis_server: RedisProcess,
                                                         tmp_path: Path) -> None:
    toml = ("[responses]\nmax_bytes = 16384\nmax_bytes_per_key = 18000\nmax_total_bytes = 30000\n"
            + _key_toml("alice", "bob", "carol"))
    gateway = _redis_keyed_gateway(sim_cluster, redis_server, tmp_path, toml)
    try:
        alice, bob, carol = (_client(gateway, f"sk-{n}") for n in ("alice", "bob", "carol"))
        first = alice.responses.create(model=MODEL, input="a" * 9000, max_output_tokens=2)
        assert _says_stored(first) is True and _says_stored(alice.responses.retrieve(first.id)) is True
        with pytest.raises(openai.BadRequestError) as full:  # over 9,000 + 9,000 bytes: refused up front
            alice.responses.create(model=MODEL, input="b" * 9000, max_output_tokens=2)
        assert full.value.body["code"] == "stored_bytes_limit" and full.value.body["param"] == "store"
        alice.responses.delete(first.id)  # room again
        assert _says_stored(alice.responses.create(model=MODEL, input="c" * 9000, max_output_tokens=2)) is True

        assert _says_stored(bob.responses.create(model=MODEL, input="d" * 9000, max_output_tokens=2)) is True
        # Alice's and Bob's over 18,000 bytes and Carol's 12,000 would pass the 30,000 of all keys:
        # Carol is served, unstored, and the response says so.
        served = carol.responses.create(model=MODEL, input="e" * 12000, max_output_tokens=2)
        assert _says_stored(served) is False and served.output_text
        with pytest.raises(openai.NotFoundError):
            carol.responses.retrieve(served.id)
        assert _metric(gateway, 'dgw_responses_not_stored_total{reason="full"}') >= 1
    finally:
        gateway.stop()


@pytest.mark.parametrize("backend", ["redis", "redis-cluster"])
async def test_redis_keeps_no_ttl_on_stored_responses_and_the_gateway_expires_them(
        backend: str, request: pytest.FixtureRequest) -> None:
    # Redis's shipped volatile-lru evicts only keys with a TTL: stored responses carry none, and
    # their expiry (and the byte budget it frees) is the gateway's own. On a cluster too: every
    # key the scripts touch is in one slot.
    import asyncio

    from deepinfer_gateway.gateway.serving.response_store import (
        BYTES_KEY,
        Quota,
        RedisResponseStore,
        StoredResponse,
    )
    from deepinfer_gateway.infra.redis_conn import redis_client
    from tests.conftest import redis_backend_url

    client = redis_client(redis_backend_url(request, backend), cluster=backend == "redis-cluster")
    ttl_s = 2  # the scan below may take a while on a loaded machine: the response must outlive it
    store = RedisResponseStore(client, Quota(ttl_s=ttl_s, max_per_key=10, max_bytes=4096, max_bytes_per_key=8192,
                                             max_total_bytes=8192))
    try:
        await client.delete(BYTES_KEY)
        owner = f"key:{uuid.uuid4().hex}"
        await store.put(owner, "resp_1", StoredResponse({"id": "resp_1"}, []))
        assert (await store.get(owner, "resp_1")) is not None
        ttls = [await client.ttl(k) async for k in client.scan_iter(match="{dgw:resp}*")]
        assert ttls and all(ttl == -1 for ttl in ttls)
        await asyncio.sleep(ttl_s + 0.1)
        assert await store.get(owner, "resp_1") is None  # expired: never served
        assert not await store.delete(owner, "resp_1")
        await store.put(owner, "resp_2", StoredResponse({"id": "resp_2"}, []))  # deletes what expired
        assert not await client.exists(f"{{dgw:resp}}:r:{store._keys(owner)[0]}:resp_1")
        assert int(await client.hget(BYTES_KEY, "*")) == len(StoredResponse({"id": "resp_2"}, []).dumps())
    finally:
        await client.aclose()


# --------------------------------------------------------------------------- a Redis outage
def _metric(gateway: Gateway, series: str) -> float:
    text = httpx.get(gateway.url + "/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(series))


def test_a_redis_outage_serves_responses_unstored_and_answers_503_for_stored_ones(
        sim_cluster: SimCluster, redis_server: RedisProcess, tmp_path: Path) -> None:
    log_path = tmp_path / "gateway.log"
    with log_path.open("wb") as log:
        gateway = _redis_keyed_gateway(sim_cluster, redis_server, tmp_path, stderr=log)
    client = _client(gateway)
    try:
        kept = client.responses.create(model=MODEL, input="before", max_output_tokens=2)
        redis_server.stop()
        for n in range(4):  # the default store: true, served unstored and marked so
            served = client.responses.create(model=MODEL, input=f"during {n}", max_output_tokens=2)
            assert _says_stored(served) is False and served.output_text
        streamed = [e for e in client.responses.create(model=MODEL, input="s", max_output_tokens=2, stream=True)
                    if e.type in ("response.completed", "response.incomplete")]
        assert _says_stored(streamed[0].response) is False
        chat = client.chat.completions.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "x"}])
        assert chat.choices[0].message.content is not None
        for call in (lambda: client.responses.retrieve(kept.id), lambda: client.responses.delete(kept.id),
                     lambda: client.responses.input_items.list(kept.id),
                     lambda: client.responses.create(model=MODEL, input="x", previous_response_id=kept.id,
                                                     max_output_tokens=2)):
            with pytest.raises(openai.InternalServerError) as unavailable:
                call()
            assert unavailable.value.status_code == 503
            assert unavailable.value.response.headers["retry-after"] == "1"
            assert unavailable.value.body["code"] == "store_unavailable"
        assert _metric(gateway, 'dgw_responses_not_stored_total{reason="unavailable"}') == 5
        time.sleep(2.5)  # the admin state's reconcile and channel retry meanwhile

        redis_server.start()  # back (empty): responses are stored again
        time.sleep(1.2)  # past the probe interval
        again = client.responses.create(model=MODEL, input="after", max_output_tokens=2)
        assert _says_stored(again) is True and client.responses.retrieve(again.id).id == again.id
    finally:
        gateway.stop()
    text = log_path.read_text()
    assert "Traceback" not in text
    assert text.count("stored responses: Redis unavailable") == 1
    assert text.count("admin state: Redis unavailable") == 1, text
    assert text.count("admin channel: Redis unavailable") == 1, text
