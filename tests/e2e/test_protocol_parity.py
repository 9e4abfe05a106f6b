"""End to end, parity with the APIs the gateway imitates (docs/api.md), with the real openai
and anthropic SDKs over loopback HTTP against real gateways and sim workers:

- unknown models: 404 `model_not_found` (OpenAI) / `not_found_error` (Anthropic);
- `GET /v1/models` and `/v1/models/{id}`: auth, the key's allow-list, `max_model_len`;
- model aliases: DeepSeek's platform names built in, vendor names from the config;
  responses echo the requested name, metrics keep the served name;
- a forced tool_choice without a thinking request is served without thinking;
- Anthropic Messages: `max_tokens` required, no `system` message role, count_tokens;
- an unexpected exception answers JSON 500 in the protocol's format;
- every error path counted in dgw_requests_total.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
import uvicorn
from starlette.requests import Request
from starlette.responses import Response

from deepinfer_gateway.config import GatewaySettings
from deepinfer_gateway.gateway.app import create_app
from harness.launch import Gateway, SimCluster, free_port, wait_for_port
from tests.fault_doubles import FaultyWorker, scrape, total

MODEL = "DeepSeek-V4.1-Flash"
CONTEXT = 65536
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ANT_WEATHER = {"name": "get_weather", "description": "Current weather in a city",
               "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
HELLO = [{"role": "user", "content": "Hello"}]


def _key(name: str, key: str, models: tuple[str, ...] = ()) -> str:
    listed = ", ".join(f'"{m}"' for m in models)
    return (f'[[api_keys]]\nname = "{name}"\nkey_sha256 = "{hashlib.sha256(key.encode()).hexdigest()}"\n'
            f"models = [{listed}]\n")


@pytest.fixture(scope="module")
def configured(sim_cluster: SimCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """Auth on, a vendor alias, a context limit of its own."""
    extra = (f"context_limit = {CONTEXT}\n"
             "[model_aliases]\n"
             f'claude-sonnet-4-5 = "{MODEL}"\n'
             + _key("full", "sk-full") + _key("served", "sk-served", (MODEL,))
             + _key("chat-only", "sk-chat", ("deepseek-chat",)) + _key("none", "sk-none", ("other-model",)))
    roles = [s.split(":") for s in sim_cluster.specs]
    gw = Gateway(tmp_path_factory.mktemp("parity"),
                 [(u, r, h) for u, (r, h) in zip(sim_cluster.urls, roles, strict=True)],
                 extra_toml=extra)
    gw.wait_ready(len(roles))
    yield gw
    gw.stop()


def oai(gw: Gateway, key: str = "test") -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0, timeout=60)


def ant(gw: Gateway, key: str = "test") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gw.url, api_key=key, max_retries=0, timeout=60)


def requests_total(gw: Gateway, **labels: str) -> float:
    return total(scrape(gw.url), "dgw_requests_total", **labels)


def _reasoning(message: Any) -> str | None:
    return getattr(message, "reasoning_content", None) or (message.model_extra or {}).get("reasoning_content")


# --- unknown models -------------------------------------------------------------------------


NOT_FOUND = {"message": "The model `gpt-4o` does not exist or you do not have access to it.",
             "type": "invalid_request_error", "param": "model", "code": "model_not_found"}


def test_unknown_model_is_openai_404_model_not_found_on_every_openai_route(gateway: Gateway) -> None:
    client = oai(gateway)
    before = requests_total(gateway, protocol="chat", model="unknown", status="404")
    calls = [lambda: client.chat.completions.create(model="gpt-4o", messages=HELLO),
             lambda: client.chat.completions.create(model="gpt-4o", messages=HELLO, stream=True),
             lambda: client.responses.create(model="gpt-4o", input="Hello"),
             lambda: client.completions.create(model="gpt-4o", prompt="Hello")]
    for call in calls:
        with pytest.raises(openai.NotFoundError) as info:
            call()
        assert info.value.status_code == 404
        assert info.value.body == NOT_FOUND
    assert requests_total(gateway, protocol="chat", model="unknown", status="404") == before + 2


def test_unknown_model_is_anthropic_not_found_error(gateway: Gateway) -> None:
    before = requests_total(gateway, protocol="messages", status="404")
    with pytest.raises(anthropic.NotFoundError) as info:
        ant(gateway).messages.create(model="claude-nope", max_tokens=10, messages=HELLO)
    assert info.value.body["type"] == "error" and info.value.body["error"]["type"] == "not_found_error"
    assert "claude-nope" in info.value.body["error"]["message"]
    assert requests_total(gateway, protocol="messages", status="404") == before + 1


# --- /v1/models ------------------------------------------------------------------------------


def test_models_retrieve_and_max_model_len(configured: Gateway) -> None:
    client = oai(configured, "sk-full")
    served = client.models.retrieve(MODEL)
    assert served.id == MODEL and served.object == "model"
    assert served.model_extra is not None and served.model_extra["max_model_len"] == CONTEXT
    assert served.model_extra["root"] == MODEL and served.model_extra["parent"] is None
    alias = client.models.retrieve("claude-sonnet-4-5")
    assert alias.id == "claude-sonnet-4-5"
    assert alias.model_extra is not None and alias.model_extra["root"] == MODEL
    assert alias.model_extra["max_model_len"] == CONTEXT
    listed = {m.id: m for m in client.models.list()}
    assert list(listed) == [MODEL, "deepseek-chat", "deepseek-reasoner", "claude-sonnet-4-5"]
    assert all(m.model_extra and m.model_extra["max_model_len"] == CONTEXT for m in listed.values())
    before = requests_total(configured, protocol="models", status="404")
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-4o")
    assert info.value.body == NOT_FOUND
    assert requests_total(configured, protocol="models", status="404") == before + 1


def test_models_need_a_valid_key(configured: Gateway) -> None:
    before = requests_total(configured, protocol="models", status="401")
    for call in (lambda: oai(configured, "sk-wrong").models.list(),
                 lambda: oai(configured, "sk-wrong").models.retrieve(MODEL)):
        with pytest.raises(openai.AuthenticationError) as info:
            call()
        assert info.value.body["type"] == "authentication_error"
    r = httpx.get(configured.url + "/v1/models")
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.AuthenticationError) as ant_info:
        ant(configured, "sk-wrong").models.list()
    assert ant_info.value.body["error"]["type"] == "authentication_error"
    assert requests_total(configured, protocol="models", status="401") == before + 4


def test_models_list_only_what_the_key_may_use(configured: Gateway) -> None:
    assert [m.id for m in oai(configured, "sk-served").models.list()] == [
        MODEL, "deepseek-chat", "deepseek-reasoner", "claude-sonnet-4-5"]  # every alias of an allowed model
    assert [m.id for m in oai(configured, "sk-chat").models.list()] == ["deepseek-chat"]
    assert [m.id for m in oai(configured, "sk-none").models.list()] == []
    with pytest.raises(openai.NotFoundError):
        oai(configured, "sk-chat").models.retrieve(MODEL)
    assert oai(configured, "sk-chat").models.retrieve("deepseek-chat").id == "deepseek-chat"
    # What the list shows is what requests may use.
    chat = oai(configured, "sk-chat")
    assert chat.chat.completions.create(model="deepseek-chat", messages=HELLO, max_tokens=4).model == "deepseek-chat"
    with pytest.raises(openai.PermissionDeniedError):
        chat.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4)


def test_anthropic_sdk_lists_and_retrieves_models(configured: Gateway) -> None:
    client = ant(configured, "sk-full")
    assert [m.id for m in client.models.list()] == [MODEL, "deepseek-chat", "deepseek-reasoner", "claude-sonnet-4-5"]
    info = client.models.retrieve("claude-sonnet-4-5")
    assert info.id == "claude-sonnet-4-5" and info.type == "model" and info.created_at.year >= 2024
    with pytest.raises(anthropic.NotFoundError) as error:
        client.models.retrieve("claude-nope")
    assert error.value.body["error"]["type"] == "not_found_error"


# --- aliases ---------------------------------------------------------------------------------


def test_deepseek_platform_code_works_unchanged(gateway: Gateway) -> None:
    client = oai(gateway)
    served = requests_total(gateway, protocol="chat", model=MODEL, status="200")
    reasoner = client.chat.completions.create(model="deepseek-reasoner", messages=HELLO, max_tokens=400)
    assert reasoner.model == "deepseek-reasoner"  # the requested name is echoed, as DeepSeek's platform does
    assert _reasoning(reasoner.choices[0].message) and reasoner.choices[0].message.content
    chat = client.chat.completions.create(model="deepseek-chat", messages=HELLO, max_tokens=400)
    assert chat.model == "deepseek-chat"
    assert not _reasoning(chat.choices[0].message) and chat.choices[0].message.content
    # The request's own thinking switch wins over the name's default.
    thinking_chat = client.chat.completions.create(model="deepseek-chat", messages=HELLO, max_tokens=400,
                                                   extra_body={"thinking": {"type": "enabled"}})
    assert _reasoning(thinking_chat.choices[0].message)
    stream = client.chat.completions.create(model="deepseek-reasoner", messages=HELLO, max_tokens=400, stream=True)
    chunks = list(stream)
    assert {c.model for c in chunks} == {"deepseek-reasoner"}  # type: ignore[attr-defined]
    assert any(c.choices and _reasoning(c.choices[0].delta) for c in chunks)  # type: ignore[attr-defined]
    # Metrics and usage keep the served name: bounded labels.
    assert requests_total(gateway, protocol="chat", model=MODEL, status="200") == served + 4
    samples = scrape(gateway.url)
    assert not [labels for (_, labels) in samples if ("model", "deepseek-chat") in labels
                or ("model", "deepseek-reasoner") in labels]


def test_configured_vendor_alias_serves_an_anthropic_agent(configured: Gateway) -> None:
    client = ant(configured, "sk-full")
    message = client.messages.create(model="claude-sonnet-4-5", max_tokens=400, tools=[ANT_WEATHER],
                                     messages=ASK)
    assert message.model == "claude-sonnet-4-5"
    assert message.stop_reason == "tool_use"
    with pytest.raises(anthropic.NotFoundError):  # not configured on the default gateway's twin: not an alias here
        client.messages.create(model="claude-opus-4", max_tokens=10, messages=HELLO)


def test_alias_of_an_unserved_model_is_a_config_error() -> None:
    with pytest.raises(ValueError, match="claude-x: model 'DeepSeek-V4-Pro' is not served"):
        GatewaySettings.model_validate({"model_aliases": {"claude-x": "DeepSeek-V4-Pro"}})
    with pytest.raises(ValueError, match="is a served model name"):
        GatewaySettings.model_validate({"model_aliases": {MODEL: {"thinking": False}}})
    settings = GatewaySettings.model_validate({"model_names": ["my-v41"], "model_aliases": {"c": {"model": "my-v41"}}})
    assert set(settings.model_aliases) == {"deepseek-chat", "deepseek-reasoner", "c"}  # built-ins stay


# --- forced tool choice ----------------------------------------------------------------------


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_choice_without_a_thinking_request_is_served_without_thinking(
        gateway: Gateway, tool_choice: Any) -> None:
    completion = oai(gateway).chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER],
                                                      tool_choice=tool_choice, max_tokens=400)
    message = completion.choices[0].message
    assert not _reasoning(message)
    (call,) = message.tool_calls or []
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    # deepseek-reasoner names a default, not a request: the forced tool still wins.
    reasoner = oai(gateway).chat.completions.create(model="deepseek-reasoner", messages=ASK, tools=[WEATHER],
                                                    tool_choice=tool_choice, max_tokens=400)
    assert reasoner.choices[0].message.tool_calls and not _reasoning(reasoner.choices[0].message)


@pytest.mark.parametrize("thinking", [{"thinking": {"type": "enabled"}}, {"reasoning_effort": "high"}])
def test_forced_tool_choice_with_an_explicit_thinking_request_is_a_400(gateway: Gateway,
                                                                       thinking: dict[str, Any]) -> None:
    before = requests_total(gateway, protocol="chat", model=MODEL, status="400")
    with pytest.raises(openai.BadRequestError) as info:
        oai(gateway).chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER],
                                             tool_choice="required", extra_body=thinking)
    assert info.value.body["param"] == "tool_choice"
    assert info.value.body["type"] == "invalid_request_error"
    assert requests_total(gateway, protocol="chat", model=MODEL, status="400") == before + 1


def test_responses_forced_tool_choice_is_served_without_thinking(gateway: Gateway) -> None:
    tool = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
            "parameters": WEATHER["function"]["parameters"]}
    response = oai(gateway).responses.create(model=MODEL, input="What is the weather in Paris?", tools=[tool],
                                             tool_choice="required", max_output_tokens=400)
    kinds = [item.type for item in response.output]
    assert "function_call" in kinds and "reasoning" not in kinds


def test_anthropic_forced_tool_choice(gateway: Gateway) -> None:
    client = ant(gateway)
    named = client.messages.create(model=MODEL, max_tokens=400, tools=[ANT_WEATHER], messages=ASK,
                                   tool_choice={"type": "tool", "name": "get_weather"})
    assert [b.type for b in named.content if b.type != "text"] == ["tool_use"]
    for choice in ({"type": "tool", "name": "get_weather"}, {"type": "any"}):
        with pytest.raises(anthropic.BadRequestError) as info:
            client.messages.create(model=MODEL, max_tokens=400, tools=[ANT_WEATHER], messages=ASK,
                                   tool_choice=choice,
                                   thinking={"type": "enabled", "budget_tokens": 200})
        assert info.value.body["error"]["type"] == "invalid_request_error"
        assert "tool_choice" in info.value.body["error"]["message"]


# --- Anthropic Messages rules and count_tokens ----------------------------------------------


def test_messages_require_max_tokens(gateway: Gateway) -> None:
    before = requests_total(gateway, protocol="messages", model=MODEL, status="400")
    with pytest.raises(anthropic.BadRequestError) as info:  # the SDK's typed create() cannot omit it
        ant(gateway).post("/v1/messages", cast_to=object, body={"model": MODEL, "messages": HELLO})
    assert info.value.body == {"type": "error", "error": {"type": "invalid_request_error",
                                                          "message": "max_tokens: Field required"}}
    assert requests_total(gateway, protocol="messages", model=MODEL, status="400") == before + 1


def test_messages_refuse_a_system_role(gateway: Gateway) -> None:
    for messages in ([{"role": "system", "content": "Be brief."}, *HELLO],
                     [*HELLO, {"role": "assistant", "content": "Hi"}, {"role": "system", "content": "x"},
                      {"role": "user", "content": "again"}]):
        with pytest.raises(anthropic.BadRequestError) as info:
            ant(gateway).messages.create(model=MODEL, max_tokens=10, messages=messages)
        assert info.value.body["error"]["type"] == "invalid_request_error"
        assert 'Unexpected role "system"' in info.value.body["error"]["message"]
    # A user message that talks about roles is not a system message.
    quoted = [{"role": "user", "content": 'In JSON: {"role": "system"}'}]
    assert ant(gateway).messages.create(model=MODEL, max_tokens=10, messages=quoted).content


def test_count_tokens_matches_what_the_engine_prefills(gateway: Gateway) -> None:
    client = ant(gateway)
    kwargs: dict[str, Any] = {"model": MODEL, "system": "Be brief.", "messages": ASK}
    counted = client.messages.count_tokens(**kwargs).input_tokens
    with_tools = client.messages.count_tokens(**kwargs, tools=[ANT_WEATHER]).input_tokens
    assert 0 < counted < with_tools
    # A prompt no earlier test sent, long enough (~2,400 tokens) for whole cached blocks.
    system = " ".join(f"count_tokens fact {i}: block {i * 7 % 1000}." for i in range(300))
    fresh = {"model": MODEL, "system": system, "messages": HELLO, "thinking": {"type": "disabled"}}
    counted_fresh = client.messages.count_tokens(**fresh).input_tokens
    for _ in range(2):  # the second time, part of the prompt may be read from the cache
        usage = client.messages.create(max_tokens=8, **fresh).usage
        assert counted_fresh == usage.input_tokens + (usage.cache_read_input_tokens or 0)
    assert client.messages.count_tokens(model="deepseek-chat", messages=ASK).input_tokens > 0


def test_count_tokens_errors_and_auth(configured: Gateway, gateway: Gateway) -> None:
    with pytest.raises(anthropic.NotFoundError) as not_found:
        ant(gateway).messages.count_tokens(model="claude-nope", messages=HELLO)
    assert not_found.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError):
        ant(gateway).messages.count_tokens(model=MODEL, messages=[{"role": "system", "content": "x"}])
    before = requests_total(configured, protocol="count_tokens", status="401")
    with pytest.raises(anthropic.AuthenticationError):
        ant(configured, "sk-wrong").messages.count_tokens(model=MODEL, messages=HELLO)
    assert requests_total(configured, protocol="count_tokens", status="401") == before + 1
    with pytest.raises(anthropic.PermissionDeniedError):
        ant(configured, "sk-none").messages.count_tokens(model=MODEL, messages=HELLO)
    allowed = ant(configured, "sk-chat").messages.count_tokens(model="deepseek-chat", messages=HELLO)
    assert allowed.input_tokens > 0
    assert requests_total(configured, protocol="count_tokens", model=MODEL, status="200") >= 1


# --- unexpected exceptions -------------------------------------------------------------------


@pytest.fixture
def broken_worker() -> Iterator[FaultyWorker]:
    worker = FaultyWorker("bad-ready")
    yield worker
    worker.stop()


def test_unexpected_exception_on_the_request_path_is_json_500(broken_worker: FaultyWorker, tmp_path: Path) -> None:
    gw = Gateway(tmp_path, [broken_worker.spec()])
    try:
        gw.wait_ready(1)
        with pytest.raises(openai.InternalServerError) as info:
            oai(gw).chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4)
        assert info.value.status_code == 500
        assert info.value.body["type"] == "server_error"
        with pytest.raises(anthropic.InternalServerError) as ant_info:
            ant(gw).messages.create(model=MODEL, max_tokens=4, messages=HELLO)
        assert ant_info.value.body["type"] == "error" and ant_info.value.body["error"]["type"] == "api_error"
        assert requests_total(gw, model=MODEL, status="500") == 2
        assert httpx.get(gw.url + "/health").status_code == 200  # the gateway carries on
    finally:
        gw.stop()


async def _raise(request: Request) -> Response:
    raise RuntimeError("a bug")


@pytest.fixture
async def in_process() -> AsyncIterator[str]:
    """The gateway app in this process, with one route that raises on the fast path and
    one on FastAPI's path: the two places an unexpected exception can escape to."""
    port = free_port()
    app = create_app(GatewaySettings(port=port))
    app.fast_routes["/v1/messages/raise"] = _raise
    app.fast_routes["/v1/chat/raise"] = _raise
    app.get("/v1/models-raise")(_raise)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical",
                                           lifespan="on", log_config=None))
    task = asyncio.create_task(server.serve())
    await asyncio.to_thread(wait_for_port, port)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    await task


async def test_unexpected_exception_escaping_an_endpoint_is_json_500(in_process: str) -> None:
    async with httpx.AsyncClient(base_url=in_process) as client:
        r = await client.post("/v1/chat/raise", json={})
        assert r.status_code == 500 and r.headers["content-type"] == "application/json"
        assert r.json()["error"]["type"] == "server_error"
        r = await client.post("/v1/messages/raise", json={})
        assert r.status_code == 500 and r.json()["error"]["type"] == "api_error"
        r = await client.get("/v1/models-raise")
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        r = await client.get("/v1/models-raise", headers={"anthropic-version": "2023-06-01"})
        assert r.status_code == 500 and r.json() == {"type": "error", "error": {
            "type": "api_error", "message": "The server had an error while processing your request."}}
