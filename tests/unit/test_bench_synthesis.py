"""Prompt synthesis is exact at the token level, after the chat template, with the real tokenizer."""

from __future__ import annotations

import orjson
import pytest

from deepinfer_gateway.recipe_bridge.encoder import PromptEncoder
from deepinfer_gateway.recipe_bridge.prepare import ApiProtocol, RequestPreparer
from deepinfer_gateway.recipe_bridge.tokenizer import load_tokenizer
from deepinfer_gateway.workload.synthesis import PromptSynthesizer
from deepinfer_gateway.workload.types import TraceRequest

B = 512
HEADER = 28  # documented in synthesis.py and docs/bench.md


@pytest.fixture(scope="module")
def synth() -> PromptSynthesizer:
    return PromptSynthesizer.for_default_tokenizer()


@pytest.fixture(scope="module")
def prompt_ids():
    preparer = RequestPreparer(PromptEncoder(load_tokenizer()))

    def ids(text: str, protocol: ApiProtocol = ApiProtocol.CHAT) -> list[int]:
        body = {"model": "DeepSeek-V4.1-Flash", "messages": [{"role": "user", "content": text}], "max_tokens": 8}
        if protocol is ApiProtocol.RESPONSES:
            body = {"model": "DeepSeek-V4.1-Flash", "input": text}
        return list(preparer.prepare(protocol, orjson.dumps(body)).token_ids)

    return ids


def test_content_is_exactly_the_blocks_after_a_fixed_header(synth: PromptSynthesizer, prompt_ids) -> None:
    a = TraceRequest(0, 0.0, 1400, 1, (10, 11, 12))
    b = TraceRequest(1, 0.0, 1800, 1, (10, 11, 13, 14))
    pa, pb = prompt_ids(synth.content(a)), prompt_ids(synth.content(b))
    assert len(pa) == HEADER + 1400 + 2 and len(pb) == HEADER + 1800 + 2
    assert pa[HEADER:-2] == synth.content_token_ids(a)
    assert pb[HEADER:-2] == synth.content_token_ids(b)
    assert pa[:HEADER] == pb[:HEADER]
    # equal ids -> equal token blocks at the same positions
    assert pa[HEADER:HEADER + 2 * B] == pb[HEADER:HEADER + 2 * B]
    # distinct ids (12 vs 13) -> the third blocks differ, even the partial one's prefix
    assert pa[HEADER + 2 * B:HEADER + 1400] != pb[HEADER + 2 * B:HEADER + 1400]
    for protocol in (ApiProtocol.RESPONSES, ApiProtocol.MESSAGES):
        assert prompt_ids(synth.content(a), protocol)[HEADER:-2] == synth.content_token_ids(a)


def test_blocks_never_merge_across_boundaries(synth: PromptSynthesizer) -> None:
    tok = load_tokenizer().tokenizer
    ids = tuple(range(100, 140))
    request = TraceRequest(0, 0.0, len(ids) * B - 100, 1, ids)
    per_block = []
    for i, h in enumerate(ids):
        n = min(B, request.input_length - B * i)
        block = tok.encode(synth.block_text(h, n))
        assert len(block) == n
        per_block += block
    assert tok.encode(synth.content(request)) == per_block == synth.content_token_ids(request)


def test_distinct_ids_give_distinct_blocks_and_text_is_deterministic(synth: PromptSynthesizer) -> None:
    blocks = {tuple(synth.content_token_ids(TraceRequest(0, 0.0, B, 1, (h,)))) for h in range(2000)}
    assert len(blocks) == 2000
    fresh = PromptSynthesizer.for_default_tokenizer()
    assert fresh.block_text(123456) == synth.block_text(123456)
    assert synth.block_text(7, 100) == synth.block_text(7)[: len(synth.block_text(7, 100))]


def test_requests_without_prefix_info_share_nothing(synth: PromptSynthesizer) -> None:
    a = synth.content_token_ids(TraceRequest(0, 0.0, 700, 1, None))
    b = synth.content_token_ids(TraceRequest(1, 0.0, 700, 1, None))
    hashed = synth.content_token_ids(TraceRequest(0, 0.0, 700, 1, (0, 1)))
    assert len(a) == 700 and a[:B] != b[:B] and a[:B] != hashed[:B]
