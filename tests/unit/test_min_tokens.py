"""`min_tokens` (vLLM's extension): parsed and bounded, honoured by the sim, passed to vLLM and
OpenAI upstreams."""

from __future__ import annotations

import orjson
import pytest

from deepinfer_gateway.core.errors import BridgeError
from deepinfer_gateway.core.protocol import FinishReason, Sampling
from deepinfer_gateway.gateway.upstream.openai import completion_body as openai_body
from deepinfer_gateway.gateway.upstream.vllm import completion_body as vllm_body
from deepinfer_gateway.recipe_bridge.encoder import PromptEncoder
from deepinfer_gateway.recipe_bridge.prepare import ApiProtocol, BridgeConfig, RequestPreparer
from deepinfer_gateway.recipe_bridge.tokenizer import load_tokenizer
from deepinfer_gateway.workers.sim.output import OutputPlanner

MODEL = "DeepSeek-V4.1-Flash"


@pytest.fixture(scope="module")
def preparer() -> RequestPreparer:
    return RequestPreparer(PromptEncoder(load_tokenizer()), BridgeConfig(model_names=(MODEL,)))


BODIES: dict[ApiProtocol, dict[str, object]] = {
    ApiProtocol.CHAT: {"messages": [{"role": "user", "content": "hi"}]},
    ApiProtocol.RESPONSES: {"input": "hi"},
    ApiProtocol.MESSAGES: {"messages": [{"role": "user", "content": "hi"}]},
    ApiProtocol.COMPLETIONS: {"prompt": "hi"},
}


@pytest.mark.parametrize("protocol", list(BODIES))
def test_min_tokens_reaches_the_sampling_of_every_protocol(preparer: RequestPreparer, protocol: ApiProtocol) -> None:
    body = {"model": MODEL, "max_tokens": 64, "min_tokens": 40, **BODIES[protocol]}
    if protocol is ApiProtocol.RESPONSES:
        body["max_output_tokens"] = body.pop("max_tokens")
    assert preparer.prepare(protocol, orjson.dumps(body)).sampling.min_tokens == 40
    del body["min_tokens"]
    assert preparer.prepare(protocol, orjson.dumps(body)).sampling.min_tokens == 0


@pytest.mark.parametrize("value", [-1, 65, "5", 2.5, True])
def test_a_bad_min_tokens_is_a_400_naming_it(preparer: RequestPreparer, value: object) -> None:
    body = {"model": MODEL, "max_tokens": 64, "min_tokens": value, **BODIES[ApiProtocol.CHAT]}
    with pytest.raises(BridgeError) as refused:
        preparer.prepare(ApiProtocol.CHAT, orjson.dumps(body))
    assert refused.value.status_code == 400 and refused.value.param == "min_tokens"


def test_the_sim_ends_no_earlier_than_min_tokens() -> None:
    planner = OutputPlanner(load_tokenizer())
    prompt = list(range(1000, 1100))
    natural = planner.plan(prompt, Sampling(max_tokens=4096))
    assert natural.finish_reason is FinishReason.STOP
    longer = planner.plan(prompt, Sampling(max_tokens=4096, min_tokens=len(natural.token_ids) + 50))
    assert longer.finish_reason is FinishReason.STOP
    assert len(longer.token_ids) >= len(natural.token_ids) + 50
    assert list(longer.token_ids[:len(natural.token_ids)]) == list(natural.token_ids)
    capped = planner.plan(prompt, Sampling(max_tokens=10, min_tokens=10))
    assert len(capped.token_ids) == 10


def test_vllm_and_openai_upstreams_get_min_tokens() -> None:
    assert vllm_body("m", [1, 2], {"min_tokens": 7}, 16)["min_tokens"] == 7
    assert "min_tokens" not in vllm_body("m", [1, 2], {}, 16)
    assert openai_body("m", "hi", {"min_tokens": 7}, 16, [])["min_tokens"] == 7
    assert "min_tokens" not in openai_body("m", "hi", {}, 16, [])
