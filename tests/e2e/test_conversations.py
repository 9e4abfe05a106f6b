"""The Conversations API through the real openai SDK and gateway: create / retrieve / update /
delete, items create / list / retrieve / delete, `conversation` on Responses (plain and
streamed), the OpenAI Agents SDK's server-managed session (OpenAIConversationsSession),
per-key scope, the bounds, a Redis crash on the shipped config, and a Redis outage."""

from __future__ import annotations

import asyncio
import hashlib
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from deepinfer_gateway.infra.redis_process import RedisProcess
from harness.launch import Gateway, SimCluster

MODEL = "deepseek-chat"  # without thinking: the whole answer is part of the follow-up's prompt
SHIPPED_CONF = Path(__file__).parents[2] / "deploy" / "k8s" / "redis.conf"


def _client(gateway: Gateway, key: str = "test") -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0, timeout=60)


def _key_toml(*names: str) -> str:
    lines = []
    for name in names:
        digest = hashlib.sha256(f"sk-{name}".encode()).hexdigest()
        lines += ["[[api_keys]]", f'name = "{name}"', f'key_sha256 = "{digest}"', ""]
    return "\n".join(lines)


def _gateway(sim_cluster: SimCluster, tmp: Path, toml: str) -> Gateway:
    roles = [spec.split(":") for spec in sim_cluster.specs]
    workers = [(url, role, hw) for url, (role, hw) in zip(sim_cluster.urls, roles, strict=True)]
    gateway = Gateway(tmp, workers, extra_toml=toml)
    gateway.wait_ready(len(workers))
    return gateway


def _texts(items: Any) -> list[str]:
    return [item.content[0].text for item in items]


def test_a_conversation_and_its_items_through_the_sdk(sim_gateway: Gateway) -> None:
    client = _client(sim_gateway)
    conv = client.conversations.create(items=[{"type": "message", "role": "user", "content": "first"}],
                                       metadata={"topic": "demo"})
    assert conv.object == "conversation" and conv.id.startswith("conv_") and conv.metadata == {"topic": "demo"}
    assert client.conversations.retrieve(conv.id).model_dump() == conv.model_dump()
    updated = client.conversations.update(conv.id, metadata={"topic": "changed"})
    assert updated.metadata == {"topic": "changed"}
    assert client.conversations.retrieve(conv.id).metadata == {"topic": "changed"}

    added = client.conversations.items.create(conv.id, items=[
        {"type": "message", "role": "assistant", "content": "second"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "third"}]}])
    assert added.object == "list" and [i.role for i in added.data] == ["assistant", "user"]
    assert all(item.id for item in added.data)
    listed = client.conversations.items.list(conv.id, order="asc")
    assert _texts(listed.data) == ["first", "second", "third"] and listed.has_more is False
    page = listed.model_dump()  # the SDK's page type declares last_id, not first_id
    assert page["first_id"] == listed.data[0].id and page["last_id"] == listed.data[-1].id
    newest = client.conversations.items.list(conv.id, limit=2)  # desc by default
    assert _texts(newest.data) == ["third", "second"] and newest.has_more is True
    assert _texts(client.conversations.items.list(conv.id, limit=2, after=newest.last_id).data) == ["first"]
    assert [item.content[0].text for item in client.conversations.items.list(conv.id)] == ["third", "second", "first"]

    second = listed.data[1]
    assert client.conversations.items.retrieve(second.id, conversation_id=conv.id).model_dump() == second.model_dump()
    after_delete = client.conversations.items.delete(second.id, conversation_id=conv.id)
    assert after_delete.id == conv.id and after_delete.object == "conversation"
    assert _texts(client.conversations.items.list(conv.id, order="asc").data) == ["first", "third"]
    with pytest.raises(openai.NotFoundError):
        client.conversations.items.retrieve(second.id, conversation_id=conv.id)

    deleted = client.conversations.delete(conv.id)
    assert deleted.model_dump() == {"id": conv.id, "object": "conversation.deleted", "deleted": True}
    for call in (lambda: client.conversations.retrieve(conv.id), lambda: client.conversations.items.list(conv.id),
                 lambda: client.conversations.delete(conv.id)):
        with pytest.raises(openai.NotFoundError):
            call()


def test_bad_conversation_requests_are_refused_in_openais_format(sim_gateway: Gateway) -> None:
    client = _client(sim_gateway)
    conv = client.conversations.create()
    cases = [
        lambda: client.conversations.create(metadata={"k": "v" * 513}),
        lambda: client.conversations.create(items=[{"type": "message", "role": "user", "content": "x"}] * 21),
        lambda: client.conversations.create(extra_body={"unknown": 1}),
        lambda: client.conversations.items.create(conv.id, items=[]),
        lambda: client.conversations.items.list(conv.id, limit=101),
        lambda: client.conversations.items.list(conv.id, after="msg_none"),
        lambda: client.conversations.items.list(conv.id, include=["reasoning.encrypted_content"]),
        lambda: client.conversations.update(conv.id, metadata="x"),
    ]
    for case in cases:
        with pytest.raises(openai.BadRequestError) as refused:
            case()
        assert refused.value.body["message"]
    item = {"type": "message", "role": "user", "content": "x", "id": "msg_fixed"}
    client.conversations.items.create(conv.id, items=[item])
    with pytest.raises(openai.BadRequestError) as duplicate:
        client.conversations.items.create(conv.id, items=[item])
    assert "msg_fixed" in duplicate.value.body["message"]


def test_responses_continue_a_conversation_and_append_to_it(sim_gateway: Gateway) -> None:
    client = _client(sim_gateway)
    conv = client.conversations.create(items=[{"type": "message", "role": "user", "content": "Remember: 42."}])
    first = client.responses.create(model=MODEL, input="What number?", conversation=conv.id, max_output_tokens=64)
    assert first.conversation is not None and first.conversation.id == conv.id
    items = client.conversations.items.list(conv.id, order="asc").data
    assert [i.type for i in items] == ["message"] * 3 and [i.role for i in items] == ["user", "user", "assistant"]
    assert items[2].id == first.output[0].id and items[2].content[0].text == first.output_text

    final = None
    for event in client.responses.create(model=MODEL, input="Again?", conversation={"id": conv.id},
                                         max_output_tokens=64, stream=True):
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response
    assert final is not None and final.conversation is not None and final.conversation.id == conv.id
    assert final.usage is not None and first.usage is not None
    # Its prompt held the whole conversation: the first turn's input, answer and this input.
    assert final.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    texts = _texts(client.conversations.items.list(conv.id, order="asc").data)
    assert texts == ["Remember: 42.", "What number?", first.output_text, "Again?", final.output_text]
    # The stored response lists the whole context it answered.
    assert _texts(client.responses.input_items.list(final.id, order="asc").data) == texts[:4]

    with pytest.raises(openai.BadRequestError) as repeated:  # its answer could not be appended
        client.responses.create(model=MODEL, conversation=conv.id, input=[
            {"type": "message", "role": "user", "id": items[0].id, "content": "Remember: 42."}])
    assert repeated.value.body["param"] == "input"
    with pytest.raises(openai.BadRequestError) as both:
        client.responses.create(model=MODEL, input="x", conversation=conv.id, previous_response_id=first.id)
    assert both.value.body["param"] == "conversation"
    with pytest.raises(openai.NotFoundError) as unknown:
        client.responses.create(model=MODEL, input="x", conversation="conv_unknown")
    assert unknown.value.body["param"] == "conversation"
    unstored = client.responses.create(model=MODEL, input="not stored", conversation=conv.id, store=False,
                                       max_output_tokens=4)
    assert unstored.conversation is not None and unstored.model_dump()["store"] is False
    assert _texts(client.conversations.items.list(conv.id, limit=2).data)[1] == "not stored"


def test_the_agents_sdk_server_managed_session_keeps_the_conversation(sim_gateway: Gateway) -> None:
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, set_tracing_disabled
    from agents.memory import OpenAIConversationsSession

    set_tracing_disabled(True)  # no export to OpenAI's tracing service

    async def run() -> tuple[str, list[dict[str, Any]]]:
        client = openai.AsyncOpenAI(base_url=sim_gateway.url + "/v1", api_key="test", max_retries=0)
        agent = Agent(name="assistant", instructions="Answer briefly.",
                      model=OpenAIResponsesModel(model=MODEL, openai_client=client),
                      model_settings=ModelSettings(max_tokens=1024))
        session = OpenAIConversationsSession(openai_client=client)
        first = await Runner.run(agent, "What is a KV cache?", session=session)
        second = await Runner.run(agent, "Say it again, shorter.", session=session)
        assert first.final_output and second.final_output
        items = await session.get_items()
        popped = await session.pop_item()
        assert popped is not None and dict(popped)["id"] == dict(items[-1])["id"]
        assert len(await session.get_items()) == len(items) - 1
        conversation_id = session.session_id
        await session.clear_session()
        await client.close()
        return conversation_id, [dict(item) for item in items]

    conversation_id, items = asyncio.run(run())
    messages = [item for item in items if item.get("type") == "message"]
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"]
    assert messages[0]["content"][0]["text"] == "What is a KV cache?"
    assert messages[2]["content"][0]["text"] == "Say it again, shorter."
    with pytest.raises(openai.NotFoundError):  # clear_session deleted it
        _client(sim_gateway).conversations.retrieve(conversation_id)


def test_conversations_are_per_key_bounded_and_survive_a_redis_crash_on_the_shipped_config(
        sim_cluster: SimCluster, tmp_path: Path) -> None:
    data = tmp_path / "redis-data"
    data.mkdir()
    server = RedisProcess(config_file=SHIPPED_CONF, data_dir=data)
    server.start()
    toml = (f'redis.url = "{server.url}"\n\n[conversations]\nmax_per_key = 2\nmax_items = 4\n'
            + _key_toml("alice", "bob"))
    gateway = _gateway(sim_cluster, tmp_path, toml)
    try:
        alice, bob = _client(gateway, "sk-alice"), _client(gateway, "sk-bob")
        conv = alice.conversations.create(items=[{"role": "user", "content": "kept"}], metadata={"a": "b"})
        answered = alice.responses.create(model=MODEL, input="and?", conversation=conv.id, max_output_tokens=4)
        item_id = alice.conversations.items.list(conv.id).data[0].id
        for call in (lambda: bob.conversations.retrieve(conv.id), lambda: bob.conversations.delete(conv.id),
                     lambda: bob.conversations.update(conv.id, metadata={}),
                     lambda: bob.conversations.items.list(conv.id),
                     lambda: bob.conversations.items.create(conv.id, items=[{"role": "user", "content": "x"}]),
                     lambda: bob.conversations.items.retrieve(item_id, conversation_id=conv.id),
                     lambda: bob.conversations.items.delete(item_id, conversation_id=conv.id),
                     lambda: bob.responses.create(model=MODEL, input="x", conversation=conv.id)):
            with pytest.raises(openai.NotFoundError):
                call()

        with pytest.raises(openai.BadRequestError) as too_many_items:
            alice.conversations.items.create(conv.id, items=[{"role": "user", "content": "x"}] * 2)
        assert too_many_items.value.body["code"] == "conversation_items_limit"
        with pytest.raises(openai.BadRequestError) as full:  # 3 items: the input and its answer would pass 4
            alice.responses.create(model=MODEL, input="x", conversation=conv.id, max_output_tokens=4)
        assert full.value.body["param"] == "conversation"
        alice.conversations.create()
        with pytest.raises(openai.BadRequestError) as too_many:
            alice.conversations.create()
        assert too_many.value.body["code"] == "conversations_limit"
        bob.conversations.create()  # bob's own count

        time.sleep(1.5)  # the shipped appendfsync everysec: a write older than a second is on disk
        server.stop()  # SIGKILL
        server.start()  # the same data directory, as the StatefulSet's volume
        assert alice.conversations.retrieve(conv.id).metadata == {"a": "b"}
        texts = _texts(alice.conversations.items.list(conv.id, order="asc").data)
        assert texts == ["kept", "and?", answered.output_text]
        with pytest.raises(openai.BadRequestError):  # the count survived too
            alice.conversations.create()
    finally:
        gateway.stop()
        server.stop()


def test_a_redis_outage_answers_503_with_retry_after(sim_cluster: SimCluster, redis_server: RedisProcess,
                                                     tmp_path: Path) -> None:
    gateway = _gateway(sim_cluster, tmp_path, f'redis.url = "{redis_server.url}"\n')
    client = _client(gateway)
    try:
        conv = client.conversations.create()
        redis_server.stop()
        for call in (lambda: client.conversations.create(), lambda: client.conversations.retrieve(conv.id),
                     lambda: client.conversations.items.list(conv.id),
                     lambda: client.responses.create(model=MODEL, input="x", conversation=conv.id)):
            with pytest.raises(openai.InternalServerError) as unavailable:
                call()
            assert unavailable.value.status_code == 503
            assert unavailable.value.response.headers["retry-after"] == "1"
            assert unavailable.value.body["code"] == "store_unavailable"
        redis_server.start()  # back, empty
        time.sleep(1.2)  # past the probe interval
        assert client.conversations.create().id
        text = httpx.get(gateway.url + "/metrics").text
        assert 'dgw_redis_errors_total{component="conversations"}' in text
    finally:
        gateway.stop()


@pytest.mark.parametrize("backend", ["redis", "redis-cluster"])
async def test_redis_keeps_no_ttl_on_conversations_and_counts_their_bytes(
        backend: str, request: pytest.FixtureRequest) -> None:
    # Redis's shipped volatile-lru evicts only keys with a TTL; on a cluster every key a script
    # touches is in one slot.
    from deepinfer_gateway.gateway.serving.conversation_store import (
        BYTES_KEY,
        ConversationFull,
        ConversationQuota,
        RedisConversationStore,
    )
    from deepinfer_gateway.infra.redis_conn import redis_client
    from tests.conftest import redis_backend_url

    client = redis_client(redis_backend_url(request, backend), cluster=backend == "redis-cluster")
    store = RedisConversationStore(client, ConversationQuota(max_per_key=5, max_items=10, max_bytes_per_key=600,
                                                             max_total_bytes=10**9))
    owner = f"key:{uuid.uuid4().hex}"
    try:
        conv = {"id": "conv_1", "object": "conversation", "created_at": 1, "metadata": {}}
        item = {"id": "msg_1", "type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}
        await store.create(owner, conv, [item])
        ttls = [await client.ttl(k) async for k in client.scan_iter(match="{dgw:conv}*")]
        assert ttls and all(ttl == -1 for ttl in ttls)
        with pytest.raises(ConversationFull):  # over the owner's 600 bytes: nothing of it kept
            await store.add_items(owner, "conv_1", [{**item, "id": "msg_2", "content": "x" * 600}])
        assert [i["id"] for i in await store.items(owner, "conv_1") or []] == ["msg_1"]
        assert await store.delete_item(owner, "conv_1", "msg_1") is True
        assert await store.delete(owner, "conv_1") is True
        digest = store._keys(owner, "conv_1")[1][0]
        assert int(await client.hget(BYTES_KEY, digest) or 0) == 0
        assert not [k async for k in client.scan_iter(match=f"{{dgw:conv}}:*{digest}*")]  # nothing left behind
    finally:
        await client.aclose()


def test_conversations_turned_off_are_not_found_and_refused_on_responses(sim_cluster: SimCluster,
                                                                         tmp_path: Path) -> None:
    gateway = _gateway(sim_cluster, tmp_path, "[conversations]\nenabled = false\n")
    try:
        client = _client(gateway)
        with pytest.raises(openai.NotFoundError) as off:
            client.conversations.create()
        assert "conversations.enabled" in off.value.body["message"]
        with pytest.raises(openai.BadRequestError) as refused:
            client.responses.create(model=MODEL, input="x", conversation="conv_1", max_output_tokens=2)
        assert refused.value.body["param"] == "conversation"
    finally:
        gateway.stop()


@pytest.mark.parametrize("backend", ["memory", "redis", "redis-cluster"])
async def test_a_store_refuses_a_write_past_its_bounds_and_keeps_nothing_of_it(
        backend: str, request: pytest.FixtureRequest) -> None:
    from deepinfer_gateway.gateway.serving.conversation_store import (
        ConversationFull,
        ConversationQuota,
        ConversationsExhausted,
        ConversationStore,
        DuplicateItem,
        MemoryConversationStore,
        RedisConversationStore,
    )
    from deepinfer_gateway.infra.redis_conn import redis_client
    from tests.conftest import redis_backend_url

    quota = ConversationQuota(max_per_key=2, max_items=3, max_bytes_per_key=700, max_total_bytes=1000)
    client = None
    store: ConversationStore
    if backend == "memory":
        store = MemoryConversationStore(quota)
    else:
        client = redis_client(redis_backend_url(request, backend), cluster=backend == "redis-cluster")
        await client.delete("{dgw:conv}:bytes")  # the total is shared by every owner of this Redis
        store = RedisConversationStore(client, quota)
    alice, bob = f"alice:{uuid.uuid4().hex}", f"bob:{uuid.uuid4().hex}"

    def conv(n: int) -> dict[str, Any]:
        return {"id": f"conv_{n}", "object": "conversation", "created_at": n, "metadata": {}}

    def item(n: int, size: int = 10) -> dict[str, Any]:
        return {"id": f"msg_{n}", "type": "message", "role": "user", "content": "x" * size}

    try:
        await store.create(alice, conv(1), [item(1)])
        await store.create(alice, conv(2), [])
        with pytest.raises(ConversationFull) as count:
            await store.create(alice, conv(3), [])
        assert count.value.code == "conversations_limit"
        with pytest.raises(ConversationFull) as items:
            await store.add_items(alice, "conv_1", [item(2), item(3), item(4)])
        assert items.value.code == "conversation_items_limit"
        with pytest.raises(DuplicateItem):
            await store.add_items(alice, "conv_1", [item(2), item(1)])
        with pytest.raises(ConversationFull) as owner_bytes:
            await store.add_items(alice, "conv_1", [item(2, 700)])
        assert owner_bytes.value.code == "conversation_bytes_limit"
        assert [i["id"] for i in await store.items(alice, "conv_1") or []] == ["msg_1"]  # nothing of them kept
        await store.create(bob, conv(1), [item(1, 400)])
        with pytest.raises(ConversationsExhausted):  # alice's own bytes have room, all owners' do not
            await store.add_items(alice, "conv_1", [item(2, 400)])
        with pytest.raises(ConversationFull):  # metadata grown past the owner's bytes
            await store.update(alice, {**conv(2), "metadata": {"k": "v" * 600}})
        assert await store.get(alice, "conv_2") == conv(2)
        assert await store.get(bob, "conv_2") is None and not await store.delete(bob, "conv_2")  # alice's
        assert await store.delete_item(alice, "conv_1", "msg_1") is True
        assert await store.delete_item(alice, "conv_1", "msg_1") is False
        assert await store.delete_item(alice, "conv_9", "msg_1") is None
        assert await store.delete(bob, "conv_1")
        await store.add_items(alice, "conv_1", [item(2, 400)])  # the bytes freed by both deletes count again
        assert await store.item_ids(alice, "conv_1") == ["msg_2"]
    finally:
        if client is not None:
            for owner in (alice, bob):
                for n in (1, 2):
                    await store.delete(owner, f"conv_{n}")
            await client.aclose()
