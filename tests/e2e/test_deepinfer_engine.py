"""DeepInferEngine against the interface double (tests/deepinfer_double)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from deepinfer_gateway.core.protocol import GenerateRequest, KvHandoff, Role, Sampling
from deepinfer_gateway.kvcache.hashing import block_hashes, kv_salt
from deepinfer_gateway.workers.deepinfer import (
    DeepInferConfig,
    DeepInferEngine,
    DeepInferNotInstalled,
    FileKvStore,
    KvStore,
    MemoryKvStore,
)
from tests.deepinfer_double import DoubleKvTransfer, core, install_as_deepinfer

Event = dict[str, Any]


def make(
    role: Role = Role.UNIFIED, store: KvStore | None = None, clock: Callable[[], float] = time.time, **cfg: Any
) -> DeepInferEngine:
    config = DeepInferConfig(model="/models/v4.1-flash", role=role, worker_id=f"w-{role.value}", **cfg)
    return DeepInferEngine(
        config, api_root="tests.deepinfer_double", kv_store=store, kv_transfer=DoubleKvTransfer(), clock=clock
    )


@pytest.fixture(autouse=True)
def fresh_double(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(core, "INSTANCES", [])  # the double's engines built by this test, in order


@pytest.fixture
async def started() -> AsyncIterator[Callable[..., Any]]:
    engines: list[DeepInferEngine] = []

    async def start(role: Role = Role.UNIFIED, store: KvStore | None = None, **cfg: Any) -> DeepInferEngine:
        engine = make(role, store, **cfg)
        await engine.start()
        engines.append(engine)
        return engine

    yield start
    for engine in engines:
        await engine.stop()


def req(rid: str, tokens: list[int] | None = None, **sampling: Any) -> GenerateRequest:
    sampling.setdefault("max_tokens", 8)
    return GenerateRequest(request_id=rid, token_ids=tokens or [11, 12, 13], sampling=Sampling(**sampling))


async def collect(engine: DeepInferEngine, request: GenerateRequest) -> list[Event]:
    return [event async for event in engine.generate(request)]


def tokens_of(events: list[Event]) -> list[int]:
    return [t for e in events if e["event"] == "tokens" for t in e["token_ids"]]


def expected(prompt: list[int], n: int) -> list[int]:
    history = list(prompt)
    for _ in range(n):
        history.append(core.next_token(history))
    return history[len(prompt) :]


def assert_shape(events: list[Event]) -> None:
    assert events[0]["event"] == "ready" and events[-1]["event"] == "finish"
    assert all(e["event"] == "tokens" for e in events[1:-1])


async def wait_for(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.005)


# --- import and construction ---------------------------------------------------------------


def test_package_import_does_not_import_deepinfer() -> None:
    code = (
        "import sys; from deepinfer_gateway.workers.deepinfer import DeepInferEngine; "
        "assert 'deepinfer' not in sys.modules and 'numpy' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_missing_deepinfer_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "deepinfer", None)
    with pytest.raises(DeepInferNotInstalled, match=r"Python 3\.12.*CUDA 13.*CANN 9\.2"):
        DeepInferEngine(DeepInferConfig(model="/m"))


async def test_real_module_paths_resolve(monkeypatch: pytest.MonkeyPatch) -> None:
    install_as_deepinfer(monkeypatch)
    engine = DeepInferEngine(DeepInferConfig(model="/m"))  # default api_root="deepinfer"
    await engine.start()
    try:
        events = await collect(engine, req("r"))
        assert tokens_of(events) == expected([11, 12, 13], 8)
    finally:
        await engine.stop()


async def test_pd_role_without_transfer_fails_at_start() -> None:
    engine = DeepInferEngine(
        DeepInferConfig(model="/m", role=Role.PREFILL), api_root="tests.deepinfer_double", kv_store=MemoryKvStore()
    )
    with pytest.raises(RuntimeError, match="KvTransfer"):
        await engine.start()
    assert not engine.healthy


def test_pd_role_needs_a_store() -> None:
    with pytest.raises(ValueError, match="KV store"):
        make(Role.DECODE, None)


# --- generation ------------------------------------------------------------------------------


async def test_generate_streams_every_token_including_the_flushed_last(started: Any) -> None:
    engine = await started()
    events = await collect(engine, req("a", max_tokens=5))
    assert_shape(events)
    assert events[0] == {"event": "ready", "prompt_tokens": 3, "cached_tokens": {"memory": 0, "store": 0}}
    assert tokens_of(events) == expected([11, 12, 13], 5)
    assert events[-1] == {"event": "finish", "reason": "length", "num_output_tokens": 5}
    assert engine.healthy


async def test_many_concurrent_requests(started: Any) -> None:
    engine = await started(max_num_seqs=16)
    prompts = {f"r{i}": [10 + i, 20 + i, 30 + i] for i in range(60)}
    results = await asyncio.gather(
        *(collect(engine, req(rid, p, max_tokens=6 + i % 5)) for i, (rid, p) in enumerate(prompts.items()))
    )
    for i, ((rid, prompt), events) in enumerate(zip(prompts.items(), results, strict=True)):
        assert_shape(events)
        assert tokens_of(events) == expected(prompt, 6 + i % 5), rid
    load = engine.load()
    assert load.prompt_tokens_total == 180 and load.running == 0


async def test_speculative_steps_group_tokens_in_one_event(started: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEEPINFER_ENABLE_MTP_VARLEN", "1")
    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", "3")
    engine = await started()
    events = await collect(engine, req("m", max_tokens=10))
    sizes = [len(e["token_ids"]) for e in events if e["event"] == "tokens"]
    assert sizes == [1, 4, 4, 1]  # prefill's token, then 1+3 per decode step, capped by max_tokens
    assert tokens_of(events) == expected([11, 12, 13], 10)


async def test_logprobs_ride_along_with_tokens(started: Any) -> None:
    engine = await started()
    events = await collect(engine, req("lp", max_tokens=2, top_logprobs=2))
    toks = [e for e in events if e["event"] == "tokens"]
    assert all(len(e["logprobs"]) == len(e["token_ids"]) for e in toks)
    first = toks[0]
    assert first["logprobs"][0] == [-0.25, [[first["token_ids"][0], -0.25], [first["token_ids"][0] + 1, -1.25]]]


@pytest.mark.parametrize(
    ("first_token", "reason", "kind", "retryable"),
    [
        (900, "error", "prompt_too_long", False),
        (901, "error", "resource_exhausted", True),
        (902, "error", "structured_output", False),
        (903, "error", "vision_encoder", False),
    ],
)
async def test_engine_finish_reasons_map_to_protocol(
    started: Any, first_token: int, reason: str, kind: str, retryable: bool
) -> None:
    engine = await started()
    events = await collect(engine, req("f", [first_token, 5, 6]))
    assert [e["event"] for e in events] == ["ready", "finish"]
    assert events[-1]["reason"] == reason
    assert events[-1]["error"]["kind"] == kind and events[-1]["error"]["retryable"] is retryable


async def test_stop_and_prompt_length(started: Any) -> None:
    engine = await started(max_model_len=4)
    stop = await collect(engine, req("s", [core.STOP_AT_FIRST, 5]))
    assert tokens_of(stop) == [] and stop[-1] == {"event": "finish", "reason": "stop", "num_output_tokens": 0}
    long = await collect(engine, req("l", [5, 6, 7, 8, 9]))
    assert long[-1]["error"]["kind"] == "prompt_too_long"


async def test_stop_token_ids_end_the_request_in_the_engine(started: Any) -> None:
    engine = await started()
    want = expected([11, 12, 13], 8)
    events = await collect(engine, req("st", max_tokens=8, stop_token_ids=(want[2],)))
    assert tokens_of(events) == want[:2]  # the stop token itself is not streamed (worker protocol)
    assert events[-1] == {"event": "finish", "reason": "stop", "num_output_tokens": 2}
    await wait_for(lambda: "st" in core.INSTANCES[-1].aborted)


@pytest.mark.parametrize(
    ("tokens", "sampling", "kind"),
    [
        ([5, 1000], {}, "invalid_tokens"),  # outside the vocabulary: add_request returns None
        ([5, -1], {}, "invalid_tokens"),
        ([5, 2**40], {}, "invalid_tokens"),  # not even int32
        ([5, 6], {"top_k": 0}, "invalid_request"),  # SamplingParams validation
    ],
)
async def test_invalid_requests_are_client_errors(
    started: Any, tokens: list[int], sampling: dict[str, Any], kind: str
) -> None:
    engine = await started()
    events = await collect(engine, req("bad", tokens, **sampling))
    assert [e["event"] for e in events] == ["ready", "finish"]
    assert events[-1]["error"] == {"kind": kind, "message": events[-1]["error"]["message"], "retryable": False}
    assert engine.healthy
    assert tokens_of(await collect(engine, req("good"))) == expected([11, 12, 13], 8)


async def test_priority_is_refused_not_ignored(started: Any) -> None:
    """LLMEngine has no priority: the worker says scheduling_policy fcfs and refuses one."""
    engine = await started()
    assert engine.info.scheduling_policy == "fcfs" and not engine.info.priority_preemption
    events = await collect(engine, req("urgent").model_copy(update={"priority": -1}))
    assert events[-1]["error"]["kind"] == "invalid_request" and "priority" in events[-1]["error"]["message"]
    plain = req("plain").model_copy(update={"priority": 0})
    assert tokens_of(await collect(engine, plain)) == expected([11, 12, 13], 8)


async def test_duplicate_request_id_is_refused(started: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(core, "STEP_DELAY_S", 0.005)
    engine = await started()
    first = engine.generate(req("dup", max_tokens=1000))
    assert (await anext(first))["event"] == "ready"
    events = await collect(engine, req("dup"))
    assert events[-1]["error"]["kind"] == "invalid_request"
    await first.aclose()


# --- aborts, failures, shutdown --------------------------------------------------------------


async def test_abort_mid_stream(started: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(core, "STEP_DELAY_S", 0.005)
    engine = await started()
    stream = engine.generate(req("ab", max_tokens=100_000))
    seen = [await anext(stream) for _ in range(3)]
    assert await engine.abort("ab") is True
    rest = [e async for e in stream]
    assert_shape(seen + rest)
    assert rest[-1]["reason"] == "abort" and rest[-1]["num_output_tokens"] >= 2
    assert "ab" in core.INSTANCES[-1].aborted
    assert await engine.abort("ab") is False and await engine.abort("never") is False


async def test_leaving_the_stream_aborts_in_the_engine(started: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(core, "STEP_DELAY_S", 0.005)
    engine = await started()
    stream = engine.generate(req("gone", max_tokens=100_000))
    await anext(stream)
    await anext(stream)
    await stream.aclose()
    await wait_for(lambda: "gone" in core.INSTANCES[-1].aborted)
    await wait_for(lambda: engine.load().running == 0)


async def test_step_exception_fails_everything_in_flight(started: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(core, "STEP_DELAY_S", 0.002)
    engine = await started()
    slow = [asyncio.create_task(collect(engine, req(f"s{i}", max_tokens=100_000))) for i in range(3)]
    await wait_for(lambda: engine.load().running == 3)
    boom = await collect(engine, req("boom", [core.RAISE_IN_STEP, 1]))
    for events in [boom, *await asyncio.gather(*slow)]:
        assert_shape(events)
        assert events[-1]["error"]["kind"] == "engine" and events[-1]["error"]["retryable"] is True
    assert not engine.healthy
    after = await collect(engine, req("after"))
    assert after[-1]["error"]["kind"] == "engine"
    await wait_for(lambda: core.INSTANCES[-1].closed)  # closed right after the failure was reported


async def test_stop_aborts_in_flight_requests_retryably(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(core, "STEP_DELAY_S", 0.002)
    engine = make(drain_timeout_s=0)
    await engine.start()
    tasks = [asyncio.create_task(collect(engine, req(f"x{i}", max_tokens=100_000))) for i in range(4)]
    await wait_for(lambda: engine.load().running == 4)
    await engine.stop()
    for events in await asyncio.gather(*tasks):
        assert_shape(events)
        assert events[-1]["error"]["kind"] == "shutting_down" and events[-1]["error"]["retryable"] is True
    double = core.INSTANCES[-1]
    assert double.closed and sorted(double.aborted) == [f"x{i}" for i in range(4)]
    late = await collect(engine, req("late"))
    assert late[-1]["error"]["kind"] == "shutting_down"


async def test_stop_lets_short_requests_finish(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(core, "STEP_DELAY_S", 0.002)
    engine = make(drain_timeout_s=5)
    await engine.start()
    tasks = [asyncio.create_task(collect(engine, req(f"d{i}", max_tokens=20))) for i in range(4)]
    await wait_for(lambda: engine.load().running == 4)
    await engine.stop()
    for events in await asyncio.gather(*tasks):
        assert events[-1]["reason"] == "length" and len(tokens_of(events)) == 20


# --- PD hand-off -------------------------------------------------------------------------------


@pytest.mark.parametrize("store_kind", ["memory", "file"])
async def test_prefill_store_decode_matches_unified(started: Any, store_kind: str, tmp_path: Any) -> None:
    store: Any = MemoryKvStore() if store_kind == "memory" else FileKvStore(tmp_path)
    prefill = await started(Role.PREFILL, store)
    decode = await started(Role.DECODE, store)
    unified = await started()
    prompt = [10 + (i * 37) % 900 for i in range(300)]  # 2 full blocks + a 44-token tail

    p_events = await collect(prefill, req("pd", prompt, max_tokens=12))
    assert [e["event"] for e in p_events] == ["ready", "tokens", "finish"]
    first = tokens_of(p_events)
    handoff = KvHandoff.model_validate(p_events[-1]["kv_handoff"])
    salt = kv_salt("DeepSeek-V4.1-Flash", "v4.1-flash/sm100-fp8")
    assert p_events[-1]["reason"] == "stop" and handoff.num_tokens == 300
    assert list(handoff.block_hashes) == block_hashes(prompt, salt) and handoff.source_worker == "w-prefill"
    stored = len([p for p in tmp_path.rglob("*") if p.is_file()]) if store_kind == "file" else len(store)
    assert stored == 3  # 2 full blocks + the tail
    assert "pd" in core.INSTANCES[0].aborted  # the prefill engine's sequence was freed

    d_request = GenerateRequest(
        request_id="pd",
        token_ids=prompt + first,
        sampling=Sampling(max_tokens=12),
        role=Role.DECODE,
        kv_handoff=handoff,
    )
    d_events = await collect(decode, d_request)
    assert d_events[0]["cached_tokens"] == {"memory": 0, "store": 300}
    assert first + tokens_of(d_events) == tokens_of(await collect(unified, req("u", prompt, max_tokens=12)))
    assert decode.load().cached_tokens_total["store"] == 300


async def test_prefill_emits_store_events_with_workload_ttl(started: Any) -> None:
    now = 1_000_000.0
    store = MemoryKvStore(clock=lambda: now)
    prefill = make(Role.PREFILL, store, clock=lambda: now)
    await prefill.start()
    try:
        prompt = list(range(10, 10 + 256))
        await collect(prefill, req("c", prompt))
        agent = req("a", [7, *prompt[1:]])
        await collect(prefill, agent.model_copy(update={"workload_class": "agent"}))
        batch = prefill.kv_events(0)
        assert [e.kind for e in batch.events] == ["cleared", "stored", "stored"]
        assert batch.events[0].tier == "memory" and batch.events[1].tier == "store"
        assert batch.events[1].expires_at == now + 7 * 86400 and batch.events[2].expires_at == now + 3 * 86400
        assert [e.seq for e in batch.events] == [1, 2, 3] and batch.last_seq == 3 and batch.epoch == prefill.info.epoch
        assert [e.seq for e in prefill.kv_events(1, limit=1).events] == [2]
        assert prefill.kv_events(3).events == []
    finally:
        await prefill.stop()


async def test_decode_refuses_bad_handoffs(started: Any) -> None:
    store = MemoryKvStore()
    prefill = await started(Role.PREFILL, store)
    decode = await started(Role.DECODE, store)
    prompt = list(range(10, 10 + 200))
    p_events = await collect(prefill, req("h", prompt))
    handoff = KvHandoff.model_validate(p_events[-1]["kv_handoff"])
    tokens = prompt + tokens_of(p_events)

    def decode_req(h: KvHandoff, ids: list[int] = tokens) -> GenerateRequest:
        return GenerateRequest(request_id="d", token_ids=ids, role=Role.DECODE, kv_handoff=h)

    cases = [
        handoff.model_copy(update={"kv_format": "v4.1-flash/ascend950-int8"}),
        handoff.model_copy(update={"handle": "kvstore:" + "0" * 16}),  # tail block not in store
        handoff.model_copy(update={"num_tokens": 10}),
    ]
    for bad in cases:
        events = await collect(decode, decode_req(bad))
        assert events[-1]["error"]["kind"] == "kv_transfer" and events[-1]["error"]["retryable"] is True
    no_handoff = await collect(decode, req("n", tokens))
    assert no_handoff[-1]["error"]["kind"] == "invalid_request"
    ok = await collect(decode, decode_req(handoff))
    assert ok[-1]["reason"] == "length"


# --- reports -----------------------------------------------------------------------------------


async def test_load_report_and_info(started: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(core, "STEP_DELAY_S", 0.002)
    engine = await started(max_num_seqs=2, hardware="ascend950")
    info = engine.info
    assert (info.engine, info.role, info.kv_format, info.dp_size) == (
        "deepinfer",
        "unified",
        "v4.1-flash/ascend950-int8",
        1,
    )
    idle = engine.load()
    assert idle.running == idle.waiting == idle.queued_prefill_tokens == 0 and idle.memory_capacity_blocks == 1024
    tasks = [asyncio.create_task(collect(engine, req(f"q{i}", [5] * 100, max_tokens=100_000))) for i in range(5)]
    await wait_for(lambda: engine.load().running == 2)
    await wait_for(lambda: engine.load().waiting == 3)
    load = engine.load()
    assert load.queued_prefill_tokens == 300 and 0 < load.kv_usage <= 1
    assert load.dp_ranks[0].running == 2 and load.dp_ranks[0].queued_prefill_tokens == 300
    for i in range(5):
        await engine.abort(f"q{i}")
    await asyncio.gather(*tasks)
