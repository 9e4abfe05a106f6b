"""Stored Responses through the real openai SDK and gateway: store, previous_response_id,
retrieve / delete / input_items, per-key scope, refused fields, restart with Redis."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from deepinfer_gateway.launch import Gateway, SimCluster
from deepinfer_gateway.redis_process import RedisProcess
from deepinfer_gateway.workload.synthesis import PromptSynthesizer
from deepinfer_gateway.workload.types import TraceRequest

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
    assert final is not None
    assert client.responses.retrieve(final.id).output_text == final.output_text


def test_store_false_and_unsupported_fields(sim_gateway: Gateway) -> None:
    client = _client(sim_gateway)
    unstored = client.responses.create(model=MODEL, input="hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    for field, value in (("background", True), ("conversation", "conv_123")):
        with pytest.raises(openai.BadRequestError) as refused:
            client.responses.create(model=MODEL, input="hi", max_output_tokens=2, extra_body={field: value})
        assert refused.value.body["param"] == field
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
    toml = f'redis_url = "{redis_server.url}"\n[responses]\nmax_per_key = 3\n' + _key_toml("alice", "bob")
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
    again = Gateway(tmp, workers, extra_toml=f'redis_url = "{redis_server.url}"\n' + _key_toml("alice", "bob"))
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
    gateway = Gateway(tmp_path, workers, extra_toml=f'redis_url = "{server.url}"\n')
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
