"""Gateway-side preprocessing and relay cost, segment-cached encoder vs deepseek-recipe's encode.

    python bench/preprocess.py [--repeats 20] [--target-tokens 128000] [--relay-tokens 200000] [--no-relay]
    python bench/preprocess.py --baseline DIR [--rounds 3] [--repeats 9] [--startups 6] [--cold-caches]

`--baseline DIR` (e.g. `git worktree add /tmp/base <commit>`): this tree against the source
tree DIR, each in its own process (PYTHONPATH=tree; each asserts it imported its own), the
gateway path of (a) and (b) below, samples alternating between the trees (which one goes
first alternates too); both trees' ids must be equal (SHA-256 of each turn). Reported:
CPU-time medians (headline: the box is shared) and wall, [min, p25, p75, max] spreads and
per-round medians (`--cold-caches`: each turn also timed after writing 64 MiB, so the CPU
caches hold none of the encoder's data, as between a gateway's requests); then `--startups`
fresh processes per tree, alternating, timing the
encoder's build (CPU) and peak RSS. `baseline_*` keys are the other tree's; JSON last.

(a) first turn: a ~128k-token multi-turn Chat Completions conversation (system prompt,
    tools, reasoning, tool calls and results) seen for the first time (cache cleared
    before every repetition); (b) follow-up: the same conversation plus an assistant
    answer and a new user message (~500 new tokens), with the cache holding exactly the
    previous turn (re-primed, untimed, before every repetition). Each is timed through
    the gateway's own path: `RequestPreparer.prepare` (orjson + convert + encode +
    max_tokens resolution) + `block_hashes(ids, kv_salt(model, kv_format))`. The
    baseline is the same path with deepseek-recipe's plain `encode`, interleaved in the
    same run. Medians of `--repeats`.

Side by side in the same run, interleaved: `pre_change_*`, the same encoder with the
tiktoken plain tokenizer (the path before fastokens; `plain_tokenizer(prefer="tiktoken")`),
and `no_segment_cache_*`, the default plain tokenizer with a zero-byte segment cache (every
segment re-tokenized: what the cache buys). `*_spread` keys: [min, p25, p75, max] of the
samples.

Also: one ~100k-token user message that grows by ~500 tokens (`long_message_append_ms`:
the encoder caches it in pieces, so only the last piece is re-tokenized; side by side,
`whole_segment_long_message_append_ms`: the same encoder with pieces off, re-tokenizing
the message whole) and CPU-time medians for the first turn (deepseek-recipe's encode uses
more than one core).

Relay: tokens/s one core turns worker NDJSON lines into SSE bytes: per message
`orjson.loads(line)` + `ResponseStream.tokens(ids)`, 4 tokens per message (the low end
of what a worker with speculative decoding sends; 1 and 8 are reported too), responses
of 2,000 tokens each (reasoning, `</think>`, answer) including `ready`/`finish` and the
per-response StreamProcessor set-up.

Last line: one JSON object: first_turn_ms, follow_up_ms, relay_tokens_per_s_per_core,
plus baseline_* and breakdown keys.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import deepseek_recipe as dr
import numpy as np
import orjson

from deepinfer_gateway.core.protocol import DEFAULT_MODEL as MODEL
from deepinfer_gateway.core.protocol import encode_line, tokens_event
from deepinfer_gateway.kvcache.hashing import PrefixHasher, block_hashes, kv_salt, pack_tokens
from deepinfer_gateway.recipe_bridge.encoder import (
    PromptEncoder,
    ReferencePromptEncoder,
)
from deepinfer_gateway.recipe_bridge.prepare import (
    ApiProtocol,
    BridgeConfig,
    RequestPreparer,
)
from deepinfer_gateway.recipe_bridge.segment_cache import DEFAULT_DIGEST_MIN_CHARS
from deepinfer_gateway.recipe_bridge.segment_tokenizer import plain_tokenizer
from deepinfer_gateway.recipe_bridge.stream import ResponseStream
from deepinfer_gateway.recipe_bridge.tokenizer import TokenizerBundle, load_tokenizer

SALT = kv_salt(MODEL, "sm100")
SALTS = [kv_salt(MODEL, fmt) for fmt in ("v4.1-flash/sm100-fp8", "v4.1-flash/ascend950-int8")]
OPTIONS = dr.ConversionOptions().with_model_versions_by_name({MODEL: dr.ModelVersion.DeepseekV41Flash})

_WORDS = [
    "the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "with", "was", "on", "be", "by", "this", "are",
    "from", "at", "or", "an", "have", "not", "which", "model", "token", "cache", "request", "latency", "prefix",
    "worker", "gateway", "decode", "prefill", "block", "hash", "tensor", "function", "return", "value", "error",
    "result", "memory", "throughput", "schedule", "batch", "queue", "stream", "client", "server", "config", "policy",
    "route", "index", "store", "engine", "vision", "image", "context", "window", "session", "agent", "because",
    "however", "therefore", "although", "quickly", "carefully", "simply", "exactly", "roughly", "probably",
]
_CODE = [
    "def handle(request):\n    if not request.ok:\n        raise ValueError(request.status)\n"
    "    return request.json()\n",
    "for (let i = 0; i < items.length; i++) {\n  total += items[i].price * 1.2;\n}\n",
    "SELECT id, name FROM users WHERE created_at > '2025-01-01' ORDER BY id LIMIT 100;\n",
]
_CJK = ["缓存命中率很高。", "请总结上面的对话。", "日本語のテキストも少し含める。"]


def _text(rng: random.Random, tokens: int) -> str:
    """Roughly `tokens` tokens of mixed prose, numbers, code and a little CJK."""
    parts: list[str] = []
    budget = tokens * 4  # ~4 characters per token for this mix
    while budget > 0:
        roll = rng.random()
        if roll < 0.08:
            piece = "\n\n```python\n" + rng.choice(_CODE) + "```\n\n"
        elif roll < 0.12:
            piece = rng.choice(_CJK)
        else:
            words = [rng.choice(_WORDS) for _ in range(rng.randint(6, 18))]
            if rng.random() < 0.3:
                words.insert(rng.randint(0, len(words)), str(rng.randint(0, 99999)))
            piece = " ".join(words).capitalize() + rng.choice([". ", ", ", "? ", "!\n"])
        parts.append(piece)
        budget -= len(piece)
    return "".join(parts)


_TOOLS = [
    {"type": "function", "function": {"name": name, "description": f"Look up {name} records.",
     "parameters": {"type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
                    "required": ["query"]}}}
    for name in ("search_docs", "read_file", "run_sql", "fetch_url")
]


def conversation(rng: random.Random, turns: int, turn_tokens: int) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": _text(rng, 1500)}]
    for turn in range(turns):
        messages.append({"role": "user", "content": _text(rng, turn_tokens)})
        if turn % 5 == 2:
            call = {"id": f"call_{turn}", "type": "function",
                    "function": {"name": "search_docs", "arguments": json.dumps({"query": _text(rng, 10)})}}
            messages.append({"role": "assistant", "content": "", "reasoning_content": _text(rng, 60),
                             "tool_calls": [call]})
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": _text(rng, turn_tokens // 2)})
        messages.append({"role": "assistant", "content": _text(rng, turn_tokens), "reasoning_content": _text(rng, 100)})
    messages.append({"role": "user", "content": _text(rng, 200)})
    return messages


def body(messages: list[dict[str, Any]], stream: bool = False, thinking: bool = True) -> bytes:
    return orjson.dumps({"model": MODEL, "messages": messages, "tools": _TOOLS, "stream": stream,
                         "thinking": {"type": "enabled" if thinking else "disabled"}})


def _ms(fn: Callable[[], Any], cpu: list[float] | None = None) -> float:
    start, start_cpu = time.perf_counter(), time.process_time()
    fn()
    if cpu is not None:
        cpu.append((time.process_time() - start_cpu) * 1000)
    return (time.perf_counter() - start) * 1000


def _pipeline(preparer: RequestPreparer, payload: bytes, hasher: PrefixHasher | None = None
              ) -> Callable[[], list[list[int]]]:
    """What the gateway does before routing: prepare, then hash the prompt once per KV format of
    the demo cluster (sm100 and ascend950), with its PrefixHasher (fast path) or plainly (baseline)."""
    def run() -> list[list[int]]:
        prepared = preparer.prepare(ApiProtocol.CHAT, payload)
        ids, packed = prepared.token_ids, prepared.packed_tokens
        if hasher is None:
            return [block_hashes(ids, salt, packed=packed) for salt in SALTS]
        return hasher.hashes(ids, SALTS, packed=packed)
    return run


def preprocess(bundle: TokenizerBundle, repeats: int, target_tokens: int,
               digest_min_chars: int | None) -> dict[str, Any]:
    config = BridgeConfig()
    fast = PromptEncoder(bundle, digest_min_chars=digest_min_chars)
    whole = PromptEncoder(bundle, digest_min_chars=digest_min_chars, piece_chars=0)
    pre_change = PromptEncoder(bundle, digest_min_chars=digest_min_chars,
                               plain=plain_tokenizer(bundle.json_text, prefer="tiktoken"))
    uncached = PromptEncoder(bundle, digest_min_chars=digest_min_chars, cache_bytes=0)
    pre_prep = RequestPreparer(pre_change, config)
    uncached_prep = RequestPreparer(uncached, config)
    whole_prep = RequestPreparer(whole, config)
    reference = ReferencePromptEncoder(bundle)
    fast_prep = RequestPreparer(fast, config)
    ref_prep = RequestPreparer(cast(PromptEncoder, reference), config)

    rng = random.Random(7)
    turns = max(1, round(target_tokens / 2530))
    messages = conversation(rng, turns, 1400)
    first = body(messages)
    follow_messages = [*messages, {"role": "assistant", "content": _text(rng, 290), "reasoning_content": ""},
                       {"role": "user", "content": _text(rng, 290)}]
    follow = body(follow_messages)
    first_ids = ref_prep.prepare(ApiProtocol.CHAT, first).token_ids
    follow_ids = ref_prep.prepare(ApiProtocol.CHAT, follow).token_ids
    for preparer in (fast_prep, pre_prep, uncached_prep):  # exact, before timing
        assert preparer.prepare(ApiProtocol.CHAT, first).token_ids == first_ids
        assert preparer.prepare(ApiProtocol.CHAT, follow).token_ids == follow_ids

    samples: dict[str, list[float]] = {k: [] for k in ("first", "follow", "base_first", "base_follow",
                                                       "convert", "encode", "hash", "first_cpu", "base_first_cpu",
                                                       "long_append", "base_long_append",
                                                       "whole_long_append", "pre_first", "pre_follow",
                                                       "pre_first_cpu", "uncached_first", "uncached_follow",
                                                       "pre_long_append", "follow_cpu", "pre_follow_cpu",
                                                       "uncached_first_cpu", "uncached_follow_cpu")}
    gc.collect()
    for _ in range(repeats):
        for encoder, preparer, key in ((pre_change, pre_prep, "pre"), (uncached, uncached_prep, "uncached")):
            encoder.cache.clear()
            samples[f"{key}_first"].append(_ms(_pipeline(preparer, first, PrefixHasher()),
                                               samples[f"{key}_first_cpu"]))
            encoder.cache.clear()
            hasher = PrefixHasher()
            _pipeline(preparer, first, hasher)()
            samples[f"{key}_follow"].append(_ms(_pipeline(preparer, follow, hasher), samples[f"{key}_follow_cpu"]))
        fast.cache.clear()
        samples["first"].append(_ms(_pipeline(fast_prep, first, PrefixHasher()), samples["first_cpu"]))  # cold
        samples["base_first"].append(_ms(_pipeline(ref_prep, first), samples["base_first_cpu"]))
        samples["base_follow"].append(_ms(_pipeline(ref_prep, follow)))
        fast.cache.clear()
        hasher = PrefixHasher()
        _pipeline(fast_prep, first, hasher)()  # the caches now hold exactly the previous turn
        samples["follow"].append(_ms(_pipeline(fast_prep, follow, hasher), samples["follow_cpu"]))
        # Breakdown of the follow-up (same state again).
        fast.cache.clear()
        hasher = PrefixHasher()
        _pipeline(fast_prep, first, hasher)()
        t0 = time.perf_counter()
        conv = _convert(follow)
        t1 = time.perf_counter()
        ids, packed = fast.encode_packed(conv)
        t2 = time.perf_counter()
        hasher.hashes(ids, SALTS, packed=packed)
        t3 = time.perf_counter()
        samples["convert"].append((t1 - t0) * 1000)
        samples["encode"].append((t2 - t1) * 1000)
        samples["hash"].append((t3 - t2) * 1000)

    # One ~100k-token user message that grows by ~500 tokens, the previous one cached.
    doc = _text(rng, 100_000)
    grown = body([{"role": "user", "content": doc + _text(rng, 500)}])
    assert fast_prep.prepare(ApiProtocol.CHAT, grown).token_ids == ref_prep.prepare(ApiProtocol.CHAT, grown).token_ids
    for _ in range(repeats):
        for encoder, preparer, key in ((fast, fast_prep, "long_append"), (whole, whole_prep, "whole_long_append"),
                                       (pre_change, pre_prep, "pre_long_append")):
            encoder.cache.clear()
            preparer.prepare(ApiProtocol.CHAT, body([{"role": "user", "content": doc}]))
            samples[key].append(_ms(_pipeline(preparer, grown)))
        samples["base_long_append"].append(_ms(_pipeline(ref_prep, grown)))

    # How many tokens the follow-up actually re-tokenized.
    fast.cache.clear()
    fast.encode(_convert(first))
    before = fast.cache_stats()
    fast.encode(_convert(follow))
    after = fast.cache_stats()

    med = {k: statistics.median(v) for k, v in samples.items() if v}
    return {
        "first_turn_ms": round(med["first"], 2),
        "follow_up_ms": round(med["follow"], 2),
        "follow_up_over_first_turn": round(med["follow"] / med["first"], 3),
        "baseline_first_turn_ms": round(med["base_first"], 2),
        "baseline_follow_up_ms": round(med["base_follow"], 2),
        "first_turn_cpu_ms": round(med["first_cpu"], 2),
        "baseline_first_turn_cpu_ms": round(med["base_first_cpu"], 2),
        "follow_up_over_baseline_first_turn": round(med["follow"] / med["base_first"], 3),
        "follow_up_convert_ms": round(med["convert"], 2),
        "follow_up_encode_ms": round(med["encode"], 2),
        "follow_up_hash_ms": round(med["hash"], 2),
        "long_message_append_ms": round(med["long_append"], 2),
        "whole_segment_long_message_append_ms": round(med["whole_long_append"], 2),
        "baseline_long_message_append_ms": round(med["base_long_append"], 2),
        "pre_change_first_turn_ms": round(med["pre_first"], 2),
        "pre_change_follow_up_ms": round(med["pre_follow"], 2),
        "pre_change_first_turn_cpu_ms": round(med["pre_first_cpu"], 2),
        "pre_change_long_message_append_ms": round(med["pre_long_append"], 2),
        "first_turn_over_pre_change": round(med["first"] / med["pre_first"], 3),
        "follow_up_over_pre_change": round(med["follow"] / med["pre_follow"], 3),
        "follow_up_cpu_ms": round(med["follow_cpu"], 2),
        "pre_change_follow_up_cpu_ms": round(med["pre_follow_cpu"], 2),
        "first_turn_cpu_over_pre_change": round(med["first_cpu"] / med["pre_first_cpu"], 3),
        "follow_up_cpu_over_pre_change": round(med["follow_cpu"] / med["pre_follow_cpu"], 3),
        "no_segment_cache_first_turn_cpu_ms": round(med["uncached_first_cpu"], 2),
        "no_segment_cache_follow_up_cpu_ms": round(med["uncached_follow_cpu"], 2),
        "no_segment_cache_first_turn_ms": round(med["uncached_first"], 2),
        "no_segment_cache_follow_up_ms": round(med["uncached_follow"], 2),
        **{f"{name}_spread": _spread(samples[key]) for name, key in (
            ("first_turn", "first"), ("follow_up", "follow"), ("pre_change_first_turn", "pre_first"),
            ("pre_change_follow_up", "pre_follow"), ("no_segment_cache_first_turn", "uncached_first"),
            ("no_segment_cache_follow_up", "uncached_follow"), ("first_turn_cpu", "first_cpu"),
            ("pre_change_first_turn_cpu", "pre_first_cpu"), ("follow_up_cpu", "follow_cpu"),
            ("pre_change_follow_up_cpu", "pre_follow_cpu"))},
        "repeats": repeats,
        "first_turn_tokens": len(first_ids),
        "follow_up_tokens": len(follow_ids),
        "follow_up_new_tokens": len(follow_ids) - len(first_ids),
        "follow_up_segment_misses": after.misses - before.misses,
        "follow_up_segment_hits": after.hits - before.hits,
        "first_turn_body_bytes": len(first),
        "plain_tokenizer": fast.plain.name,
        "pre_change_plain_tokenizer": pre_change.plain.name,
    }


def _spread(values: list[float]) -> list[float]:
    """[min, p25, p75, max]."""
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return [round(v, 2) for v in (min(values), q[0], q[2], max(values))]


def _convert(payload: bytes) -> dr.Conversation:
    return dr.ChatCompletionRequest(payload).convert(OPTIONS).conversation


def relay(bundle: TokenizerBundle, total_tokens: int, per_message: int, response_tokens: int = 2000) -> float:
    """Tokens/s: NDJSON line -> orjson -> ResponseStream.tokens -> SSE bytes, one thread."""
    preparer = RequestPreparer(PromptEncoder(bundle, cache_bytes=1 << 20))
    prepared_body = body([{"role": "user", "content": "Explain KV caching."}], stream=True)
    rng = random.Random(3)
    plain = PromptEncoder(bundle, cache_bytes=0).plain
    reasoning = plain.encode(_text(rng, response_tokens // 2))[: response_tokens // 2]
    answer = plain.encode(_text(rng, response_tokens))[: response_tokens - len(reasoning) - 1]
    end_think = bundle.special_token_id("</think>")
    ids = [*reasoning, end_think, *answer]
    lines = [encode_line(tokens_event(ids[i : i + per_message])) for i in range(0, len(ids), per_message)]
    responses = max(1, total_tokens // len(ids))
    sent = 0
    gc.collect()
    start_wall, start_cpu = time.perf_counter(), time.process_time()
    for n in range(responses):
        prepared = preparer.prepare(ApiProtocol.CHAT, prepared_body)
        stream = ResponseStream(prepared, bundle, f"chatcmpl-{n}")
        sent += len(stream.ready(12, 0))
        for line in lines:
            event = orjson.loads(line)
            sent += len(stream.tokens(event["token_ids"], event.get("logprobs")))
        sent += len(stream.finish("stop"))
    wall, cpu = time.perf_counter() - start_wall, time.process_time() - start_cpu
    assert sent > 0
    return responses * len(ids) / max(wall, cpu)  # max: never credit a second core


# --- This tree against another source tree, each in its own process (--baseline) ------------


def _turns(target_tokens: int) -> tuple[bytes, bytes]:
    """The first turn and follow-up bodies `preprocess` times (same seed, same texts)."""
    rng = random.Random(7)
    messages = conversation(rng, max(1, round(target_tokens / 2530)), 1400)
    follow = [*messages, {"role": "assistant", "content": _text(rng, 290), "reasoning_content": ""},
              {"role": "user", "content": _text(rng, 290)}]
    return body(messages), body(follow)


def child(mode: str, target_tokens: int) -> None:
    """One tree's side: build the encoder (start-up, timed), then time `first`/`follow`
    commands read from stdin, one JSON line per answer."""
    import deepinfer_gateway  # the tree on this process's PYTHONPATH
    cpu0, wall0 = time.process_time(), time.perf_counter()
    bundle = load_tokenizer()
    encoder = PromptEncoder(bundle)
    build_cpu, build_wall = time.process_time() - cpu0, time.perf_counter() - wall0
    ready = {"package": deepinfer_gateway.__file__, "build_cpu_ms": build_cpu * 1000,
             "build_wall_ms": build_wall * 1000, "process_cpu_ms": time.process_time() * 1000,
             "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    if mode == "startup":
        print(json.dumps(ready), flush=True)
        return
    preparer = RequestPreparer(encoder, BridgeConfig())
    first, follow = _turns(target_tokens)
    digests = [hashlib.sha256(pack_tokens(preparer.prepare(ApiProtocol.CHAT, b).token_ids)).hexdigest()
               for b in (first, follow)]
    print(json.dumps({**ready, "digests": digests, "plain": encoder.plain.name}), flush=True)
    gc.collect()
    evict = np.zeros(_EVICT_BYTES, dtype=np.uint8)
    for line in sys.stdin:
        turn, _, cold = line.strip().partition("-")
        cpu: list[float] = []
        encoder.cache.clear()
        hasher = PrefixHasher()
        if turn == "follow":
            _pipeline(preparer, first, hasher)()  # the caches hold exactly the previous turn
        if cold:
            evict += 1  # out of the CPU caches: what a gateway's other work does between requests
        wall = _ms(_pipeline(preparer, first if turn == "first" else follow, hasher), cpu)
        print(json.dumps({"wall": wall, "cpu": cpu[0]}), flush=True)


_EVICT_BYTES = 64 << 20  # more than any last-level cache of the machines benchmarked here


def _spawn(tree: str, mode: str, target_tokens: int) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONSAFEPATH": "1", "PYTHONPATH": tree}
    return subprocess.Popen([sys.executable, __file__, "--child", mode, "--target-tokens", str(target_tokens)],
                            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def _ask(proc: subprocess.Popen[str], command: str | None = None) -> dict[str, Any]:
    assert proc.stdin is not None and proc.stdout is not None
    if command is not None:
        proc.stdin.write(command + "\n")
        proc.stdin.flush()
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"child exited ({proc.wait()})")
    answer: dict[str, Any] = json.loads(line)
    return answer


def versus(baseline: str, rounds: int, repeats: int, startups: int, target_tokens: int,
           cold: bool = False) -> dict[str, Any]:
    """Both trees' first turn and follow-up, samples alternating between the trees (the
    first tree of each sample alternates too), then `startups` fresh processes per tree
    alternating; CPU time is the headline (the box is shared), wall beside it. `cold`: each
    turn also timed with the CPU caches emptied first (`*_cold_*` keys)."""
    turns = {"first": "first", "follow": "follow"}
    if cold:
        turns |= {"first-cold": "first_cold", "follow-cold": "follow_cold"}
    trees = {"": str(Path(__file__).resolve().parent.parent), "baseline_": str(Path(baseline).resolve())}
    procs = {prefix: _spawn(tree, "serve", target_tokens) for prefix, tree in trees.items()}
    ready = {prefix: _ask(proc) for prefix, proc in procs.items()}
    for prefix, tree in trees.items():  # each child imported its own tree
        assert ready[prefix]["package"].startswith(tree + "/"), (ready[prefix]["package"], tree)
    assert ready[""]["digests"] == ready["baseline_"]["digests"], "the trees' token ids differ"
    samples: dict[str, list[float]] = {f"{p}{t}_{k}": [] for p in trees for t in turns.values()
                                       for k in ("cpu", "wall")}
    round_medians: dict[str, list[float]] = {f"{p}{t}_cpu": [] for p in trees for t in turns.values()}
    n = 0
    for _ in range(rounds):
        start = {k: len(v) for k, v in samples.items()}
        for _ in range(repeats):
            order = list(trees) if n % 2 == 0 else list(trees)[::-1]
            n += 1
            for command, turn in turns.items():
                for prefix in order:
                    answer = _ask(procs[prefix], command)
                    samples[f"{prefix}{turn}_cpu"].append(answer["cpu"])
                    samples[f"{prefix}{turn}_wall"].append(answer["wall"])
        for key in round_medians:
            round_medians[key].append(round(statistics.median(samples[key][start[key]:]), 2))
    for proc in procs.values():
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait()
    boot: dict[str, list[float]] = {f"{p}{k}": [] for p in trees for k in ("build_cpu", "process_cpu", "rss")}
    for i in range(startups):
        for prefix in (list(trees) if i % 2 == 0 else list(trees)[::-1]):
            proc = _spawn(trees[prefix], "startup", target_tokens)
            answer = _ask(proc)
            proc.wait()
            boot[f"{prefix}build_cpu"].append(answer["build_cpu_ms"])
            boot[f"{prefix}process_cpu"].append(answer["process_cpu_ms"])
            boot[f"{prefix}rss"].append(answer["rss_mib"])
    med = {k: statistics.median(v) for k, v in {**samples, **boot}.items() if v}
    result: dict[str, Any] = {"baseline_tree": trees["baseline_"], "exact": True,
                              "first_turn_tokens": target_tokens, "rounds": rounds, "repeats_per_round": repeats}
    for prefix in trees:
        result.update({
            f"{prefix}first_turn_cpu_ms": round(med[f"{prefix}first_cpu"], 2),
            f"{prefix}first_turn_ms": round(med[f"{prefix}first_wall"], 2),
            f"{prefix}follow_up_cpu_ms": round(med[f"{prefix}follow_cpu"], 2),
            f"{prefix}follow_up_ms": round(med[f"{prefix}follow_wall"], 2),
            f"{prefix}first_turn_cpu_spread": _spread(samples[f"{prefix}first_cpu"]),
            f"{prefix}follow_up_cpu_spread": _spread(samples[f"{prefix}follow_cpu"]),
            f"{prefix}first_turn_cpu_round_medians": round_medians[f"{prefix}first_cpu"],
            f"{prefix}follow_up_cpu_round_medians": round_medians[f"{prefix}follow_cpu"],
            f"{prefix}plain_tokenizer": ready[prefix]["plain"],
        })
        if startups:
            result.update({
                f"{prefix}encoder_build_cpu_ms": round(med[f"{prefix}build_cpu"], 1),
                f"{prefix}encoder_build_cpu_spread": _spread(boot[f"{prefix}build_cpu"]),
                f"{prefix}process_cpu_at_ready_ms": round(med[f"{prefix}process_cpu"], 1),
                f"{prefix}peak_rss_at_ready_mib": round(med[f"{prefix}rss"], 1),
                f"{prefix}peak_rss_at_ready_spread": _spread(boot[f"{prefix}rss"]),
            })
        if cold:
            result.update({
                f"{prefix}first_turn_cold_cpu_ms": round(med[f"{prefix}first_cold_cpu"], 2),
                f"{prefix}follow_up_cold_cpu_ms": round(med[f"{prefix}follow_cold_cpu"], 2),
                f"{prefix}first_turn_cold_cpu_spread": _spread(samples[f"{prefix}first_cold_cpu"]),
                f"{prefix}follow_up_cold_cpu_spread": _spread(samples[f"{prefix}follow_cold_cpu"]),
            })
    result["first_turn_cpu_over_baseline"] = round(med["first_cpu"] / med["baseline_first_cpu"], 3)
    result["follow_up_cpu_over_baseline"] = round(med["follow_cpu"] / med["baseline_follow_cpu"], 3)
    if cold:
        result["first_turn_cold_cpu_over_baseline"] = round(med["first_cold_cpu"] / med["baseline_first_cold_cpu"], 3)
        result["follow_up_cold_cpu_over_baseline"] = round(med["follow_cold_cpu"] / med["baseline_follow_cold_cpu"], 3)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--target-tokens", type=int, default=128_000)
    parser.add_argument("--relay-tokens", type=int, default=200_000)
    parser.add_argument("--digest-min-chars", type=int, default=DEFAULT_DIGEST_MIN_CHARS,
                        help="key segments this long by SHA-256 (default: every segment by its text)")
    parser.add_argument("--no-relay", action="store_true", help="skip the relay throughput part")
    parser.add_argument("--baseline", metavar="DIR",
                        help="instead: this tree against the source tree DIR (e.g. a `git worktree` of the "
                             "pre-change commit), each in its own process, samples alternating")
    parser.add_argument("--rounds", type=int, default=3, help="with --baseline: rounds of --repeats samples")
    parser.add_argument("--startups", type=int, default=5,
                        help="with --baseline: fresh processes per tree timing the encoder's start-up")
    parser.add_argument("--cold-caches", action="store_true",
                        help="with --baseline: also time each turn with the CPU caches emptied first")
    parser.add_argument("--child", choices=("serve", "startup"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.target_tokens)
        return
    if args.baseline:
        result = versus(args.baseline, args.rounds, args.repeats, args.startups, args.target_tokens,
                        args.cold_caches)
        for key, value in result.items():
            print(f"{key:40s} {value}")
        print(json.dumps(result))
        return
    bundle = load_tokenizer()
    result = preprocess(bundle, args.repeats, args.target_tokens, args.digest_min_chars)
    for key, value in result.items():
        print(f"{key:32s} {value}")
    if args.no_relay:
        print(json.dumps(result))
        return
    rates = {n: relay(bundle, args.relay_tokens, n) for n in (1, 4, 8)}
    for n, rate in rates.items():
        print(f"relay {n} tokens/message          {rate:,.0f} tokens/s/core")
    result["relay_tokens_per_s_per_core"] = round(rates[4])
    result["relay_tokens_per_s_per_core_1_per_message"] = round(rates[1])
    result["relay_tokens_per_s_per_core_8_per_message"] = round(rates[8])
    print(json.dumps(result))


if __name__ == "__main__":
    main()
