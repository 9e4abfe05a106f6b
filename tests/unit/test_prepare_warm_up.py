"""`RequestPreparer.warm_up`: the request a process prepares at start, before its first client's."""

from __future__ import annotations

import orjson
import pytest

from deepinfer_gateway.core.errors import BridgeError
from deepinfer_gateway.core.protocol import DEFAULT_MODEL
from deepinfer_gateway.recipe_bridge.encoder import PromptEncoder
from deepinfer_gateway.recipe_bridge.prepare import ApiProtocol, BridgeConfig, RequestPreparer
from deepinfer_gateway.recipe_bridge.tokenizer import load_tokenizer


def test_warm_up_prepares_for_the_model_the_gateway_serves() -> None:
    preparer = RequestPreparer(PromptEncoder(load_tokenizer()), BridgeConfig(model_names=("acme-coder",)))
    body = orjson.dumps({"model": DEFAULT_MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]})
    with pytest.raises(BridgeError):  # a hard-coded model name would be refused here
        preparer.prepare(ApiProtocol.CHAT, body)
    misses = preparer.encoder.cache.stats().misses
    preparer.warm_up()
    assert preparer.encoder.cache.stats().misses > misses  # its texts went through the tokenizer
