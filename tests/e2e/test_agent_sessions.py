"""Agent clients' sessions through the real HTTP front end (real openai and anthropic SDKs), with
session affinity over round-robin: a request that names no session moves to the next worker, so
a follow-up that stays put was kept by the session the gateway read. Subagents' first requests
land on their parent's worker; with two replicas on one Redis, a session's follow-ups stay on one
worker whichever replica serves them."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import anthropic
import openai
import pytest

from harness.launch import Gateway, SimCluster
from tests.fault_doubles import scrape, total

MODEL = "DeepSeek-V4.1-Flash"
AFFINITY = '[router]\npolicy = "round_robin"\n[router.session_affinity]\nenabled = true\n'


@pytest.fixture(scope="module")
def cluster() -> Iterator[SimCluster]:
    c = SimCluster("unified:sm100,unified:sm100,unified:sm100", time_scale=20.0)
    yield c
    c.stop()


def _workers(cluster: SimCluster) -> list[tuple[str, str, str]]:
    return [(url, spec.split(":")[0], spec.split(":")[1]) for url, spec in zip(cluster.urls, cluster.specs,
                                                                            strict=True)]


@pytest.fixture(scope="module")
def gateway(cluster: SimCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    gw = Gateway(tmp_path_factory.mktemp("agents"), _workers(cluster), extra_toml=AFFINITY)
    gw.wait_ready(3)
    yield gw
    gw.stop()


def _oai(gw: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=30)


def _chat(gw: Gateway, headers: dict[str, str] | None = None) -> str:
    raw = _oai(gw).chat.completions.with_raw_response.create(
        model=MODEL, max_tokens=2, messages=[{"role": "user", "content": uuid.uuid4().hex}],
        extra_headers=headers or {})
    return raw.headers["x-dgw-worker"]


def _responses(gw: Gateway, headers: dict[str, str]) -> str:
    raw = _oai(gw).responses.with_raw_response.create(
        model=MODEL, max_output_tokens=16, input=uuid.uuid4().hex, extra_headers=headers)
    return raw.headers["x-dgw-worker"]


def _messages(gw: Gateway, headers: dict[str, str] | None = None, user_id: str | None = None) -> str:
    client = anthropic.Anthropic(base_url=gw.url, api_key="unused", max_retries=0, timeout=30)
    raw = client.messages.with_raw_response.create(
        model=MODEL, max_tokens=2, messages=[{"role": "user", "content": uuid.uuid4().hex}],
        extra_headers=headers or {}, metadata={"user_id": user_id} if user_id else anthropic.NOT_GIVEN)
    return raw.headers["x-dgw-worker"]


def _noise(gw: Gateway) -> None:
    _chat(gw)  # names no session: moves round-robin on


@pytest.mark.parametrize("source", [
    "dynamo", "claude-code", "codex", "codex-legacy", "opencode", "opencode-zen", "correlation"])
def test_each_clients_session_header_keeps_its_follow_ups(gateway: Gateway, source: str) -> None:
    sid = uuid.uuid4().hex
    headers = {"dynamo": {"x-dynamo-session-id": sid}, "claude-code": {"x-claude-code-session-id": sid},
               "codex": {"session-id": sid, "thread-id": sid}, "codex-legacy": {"session_id": sid},
               "opencode": {"x-session-id": sid, "x-session-affinity": sid},
               "opencode-zen": {"x-opencode-session": sid}, "correlation": {"x-correlation-id": sid}}[source]

    def send() -> str:
        if source == "claude-code":
            return _messages(gateway, headers)
        if source.startswith("codex"):
            return _responses(gateway, headers)
        return _chat(gateway, headers)

    first = send()
    kept = []
    for _ in range(3):
        _noise(gateway)
        kept.append(send())
    assert set(kept) == {first}, kept


def test_without_a_session_requests_move_round_robin(gateway: Gateway) -> None:
    """The control: the same requests naming no session do not stay."""
    assert len({_chat(gateway) for _ in range(3)}) == 3


def test_a_sessions_rounds_count_as_extending_or_breaking_its_prefix(gateway: Gateway) -> None:
    """Why a session's follow-up hit is low, on /metrics: a round whose prompt does not start with
    the session's previous one (the agent compacted its history) counts apart from those that
    extend it, whichever worker serves it."""
    client = anthropic.Anthropic(base_url=gateway.url, api_key="unused", max_retries=0, timeout=30)
    headers = {"x-claude-code-session-id": uuid.uuid4().hex}
    history: list[anthropic.types.MessageParam] = [
        {"role": "user", "content": " ".join(f"step{i}" for i in range(400))}]  # several KV blocks

    def send(messages: list[anthropic.types.MessageParam]) -> None:
        client.messages.create(model=MODEL, max_tokens=2, system="You are a coding agent.", messages=messages,
                               extra_headers=headers)

    before = scrape(gateway.url)
    send(history)
    history += [{"role": "assistant", "content": "Done."}, {"role": "user", "content": "Now the tests."}]
    send(history)
    send([{"role": "user", "content": "Summary of the session so far: the steps are done. Now the tests."}])
    _chat(gateway)  # no session: not counted
    after = scrape(gateway.url)
    counted = {prefix: total(after, "dgw_session_rounds_total", prefix=prefix)
               - total(before, "dgw_session_rounds_total", prefix=prefix) for prefix in ("unseen", "extends", "breaks")}
    assert counted == {"unseen": 1, "extends": 1, "breaks": 1}


def test_claude_codes_metadata_user_id_names_the_session(gateway: Gateway) -> None:
    """Claude Code's metadata.user_id (a JSON string carrying its session_id) in the Anthropic SDK."""
    user_id = json.dumps({"device_id": "d", "account_uuid": "", "session_id": str(uuid.uuid4())})
    first = _messages(gateway, user_id=user_id)
    for _ in range(3):
        _noise(gateway)
        assert _messages(gateway, user_id=user_id) == first


@pytest.mark.parametrize("client", ["claude-code", "codex", "opencode", "dynamo"])
def test_a_subagents_first_request_lands_on_its_parents_worker(gateway: Gateway, client: str) -> None:
    root, child = uuid.uuid4().hex, uuid.uuid4().hex
    parent_headers, child_headers = {
        "claude-code": ({"x-claude-code-session-id": root},
                        {"x-claude-code-session-id": root, "x-claude-code-agent-id": child}),
        "codex": ({"session-id": root, "thread-id": root},
                  {"session-id": root, "thread-id": child, "x-codex-parent-thread-id": root,
                   "x-openai-subagent": "collab_spawn"}),
        "opencode": ({"x-session-id": root}, {"x-session-id": child, "x-parent-session-id": root}),
        "dynamo": ({"x-dynamo-session-id": root},
                   {"x-dynamo-session-id": child, "x-dynamo-parent-session-id": root}),
    }[client]
    send = _messages if client == "claude-code" else _chat
    parent_worker = send(gateway, parent_headers)
    _noise(gateway)
    assert send(gateway, child_headers) == parent_worker
    before = total(scrape(gateway.url), "dgw_routing_decisions_total", reason="lineage")
    other = uuid.uuid4().hex  # a second subagent, first request: lineage again
    sibling = dict(child_headers)
    for name in ("x-claude-code-agent-id", "thread-id", "x-session-id", "x-dynamo-session-id"):
        if name in sibling and sibling[name] == child:
            sibling[name] = other
    _noise(gateway)
    assert send(gateway, sibling) == parent_worker
    assert total(scrape(gateway.url), "dgw_routing_decisions_total", reason="lineage") == before + 1


def test_two_replicas_on_one_redis_keep_a_session_on_one_worker(
        cluster: SimCluster, redis_url: str, tmp_path: Path) -> None:
    """Requests of a session alternate between two replicas (each moving its own round-robin on
    between them): the session's worker is the one the replicas share in Redis, and so is a
    subagent's parent's."""
    toml = f'redis.url = "{redis_url}"\nredis.timeout_s = 10\n' + AFFINITY
    a, b = (Gateway(tmp_path, _workers(cluster), extra_toml=toml) for _ in range(2))
    try:
        for gw in (a, b):
            gw.wait_ready(3)
        _noise(b)  # the replicas' round-robins now differ: a replica that kept sessions alone would move it
        sid = uuid.uuid4().hex
        first = _chat(a, {"x-session-id": sid})
        for i in range(6):
            gw = (b, a)[i % 2]
            _noise(gw)
            assert _chat(gw, {"x-session-id": sid}) == first, i
        child = _chat(b, {"x-session-id": uuid.uuid4().hex, "x-parent-session-id": sid})
        assert child == first
        for gw in (a, b):
            assert total(scrape(gw.url), "dgw_redis_errors_total") == 0
    finally:
        for gw in (a, b):
            gw.stop()
