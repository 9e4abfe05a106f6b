"""Measure what the live gateway spends per request before routing, on this machine.

`measure_gateway_cost()` runs, on bench-style synthesized prompts of two sizes, the
per-request work of the live path before the engine schedules a request: the gateway's
preparation (`RequestPreparer`: JSON, chat template, tokenization), block hashing for two
KV formats, the worker body's JSON encoding, and the worker's parsing and hashing of it
(`GenerateRequest`, one more hash). It fits `fixed + per_token * tokens` to the wall time
(wall, not CPU: a busy machine slows the live processes the same way). `offload_tokens`:
the prompt length whose body (as synthesized here, ~7 bytes per token) exceeds
`OFFLOAD_BODY_BYTES`, i.e. from which the gateway prepares in its thread. The result goes
into a cluster's `[gateway]` table. Socket and SSE relay costs are not included.
"""

from __future__ import annotations

import math
import time

import orjson

from deepinfer_gateway.core.protocol import DEFAULT_MODEL
from deepinfer_gateway.kvcache.packed_ids import ids_json
from deepinfer_gateway.simulate.config import GatewayCost


def measure_gateway_cost(sizes: tuple[int, int] = (2_000, 30_000), repeats: int = 5) -> GatewayCost:
    from deepinfer_gateway.core.protocol import GenerateRequest
    from deepinfer_gateway.kvcache.hashing import block_hashes, kv_salt
    from deepinfer_gateway.recipe_bridge.encoder import PromptEncoder
    from deepinfer_gateway.recipe_bridge.prepare import OFFLOAD_BODY_BYTES, ApiProtocol, RequestPreparer
    from deepinfer_gateway.recipe_bridge.tokenizer import load_tokenizer
    from deepinfer_gateway.workload.synthesis import PromptSynthesizer, Vocabulary
    from deepinfer_gateway.workload.types import TraceRequest

    bundle = load_tokenizer()
    synthesizer = PromptSynthesizer(Vocabulary.from_tokenizer(bundle.tokenizer, bundle.json_text))
    preparer = RequestPreparer(PromptEncoder(bundle))
    salts = [kv_salt(DEFAULT_MODEL, "a"), kv_salt(DEFAULT_MODEL, "b")]
    # Untimed warm-up: the first prepare builds the tokenizer's fast path (~0.7 s), a one-off
    # the live gateway pays at start-up, not per request.
    warm = TraceRequest(0, 0.0, 600, 16, (1, 2))
    preparer.prepare(ApiProtocol.CHAT, orjson.dumps({"model": DEFAULT_MODEL, "max_tokens": 16, "messages": [
        {"role": "user", "content": synthesizer.content(warm)}]}))
    points: list[tuple[int, float]] = []
    bytes_per_token = 0.0
    for n in sizes:
        times = []
        for k in range(repeats):  # distinct block ids: no segment-cache hits across repeats
            first = 10**7 * (k + 1) + n
            request = TraceRequest(0, 0.0, n, 16, tuple(range(first, first + -(-n // 512))))
            messages = [{"role": "user", "content": synthesizer.content(request)}]
            body = orjson.dumps({"model": DEFAULT_MODEL, "messages": messages,
                                 "max_tokens": 16, "stream": True, "ignore_eos": True})
            bytes_per_token = len(body) / n
            started = time.perf_counter()
            prepared = preparer.prepare(ApiProtocol.CHAT, body)
            for salt in salts:  # as the gateway does: from the encoder's packed tokens
                block_hashes(prepared.token_ids, salt, packed=prepared.packed_tokens)
            wire = ids_json({"request_id": "r", "token_ids": prepared.token_ids, "role": "prefill"})
            received = GenerateRequest.model_validate_json(wire)
            block_hashes(received.token_ids, salts[0])
            times.append(time.perf_counter() - started)
        points.append((n, sorted(times)[len(times) // 2]))
    (n0, t0), (n1, t1) = points
    per_token = max(0.0, (t1 - t0) / (n1 - n0))
    return GatewayCost(request_overhead_s=max(0.0, t0 - per_token * n0), per_prompt_token_s=per_token,
                       offload_tokens=math.ceil(OFFLOAD_BODY_BYTES / bytes_per_token))
