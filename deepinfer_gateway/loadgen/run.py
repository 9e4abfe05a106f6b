"""One bench run: load and slice the trace, replay it, write results, summary and plots.

A session workload (`workload.sessions`: TraceLab or Dynamo agentic files, told apart by
their content, or `synthetic:agent:loop=closed`) is replayed closed loop, round by round
(`loadgen/sessions.py`); its summary adds the session figures and `by_round.png`.

Output directory layout:
  results.jsonl   one `RequestRecord` per line (trace order)
  summary.json    `summarize(...)` plus run metadata (schema: docs/bench.md)
  ttft_cdf.png, hit_rate.png (and by_round.png for sessions)
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deepinfer_gateway.core.protocol import DEFAULT_MODEL
from deepinfer_gateway.loadgen import gateway_metrics, plots
from deepinfer_gateway.loadgen.client import ClientConfig, ProtocolClient
from deepinfer_gateway.loadgen.replay import ReplayConfig, ReplayResult, replay
from deepinfer_gateway.loadgen.sessions import SessionReplayConfig, SessionReplayResult, replay_sessions
from deepinfer_gateway.loadgen.turns import Turn
from deepinfer_gateway.workload.oracle import oracle_hit_rate
from deepinfer_gateway.workload.sessions import Round, SessionTrace, is_session_spec, load_sessions
from deepinfer_gateway.workload.summary import PERCENTILES, CostModel, Slo, TierTokens, session_figures, summarize
from deepinfer_gateway.workload.synthesis import PromptSynthesizer, Vocabulary
from deepinfer_gateway.workload.trace_sources import SOURCES
from deepinfer_gateway.workload.traces import load_trace
from deepinfer_gateway.workload.types import MOONCAKE_BLOCK_TOKENS, RequestRecord, Trace, TraceRequest, write_records


@dataclass(frozen=True)
class BenchConfig:
    url: str
    trace: str
    out: Path
    protocol: str = "chat"
    model: str | None = None
    api_key: str = "bench"
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    max_requests: int | None = None
    slo: Slo | None = None
    cost: CostModel | None = None
    tokenizer: str | None = None
    max_connections: int = 1024
    request_timeout_s: float = 600.0
    ignore_eos: bool = False
    lean_client: bool = False  # ClientConfig.lean
    tool_calls: bool = False  # sessions: rounds as tool calls and their results (loadgen/turns.py)
    hit_window_s: float | None = None
    plots: bool = True
    percentiles: tuple[float, ...] = PERCENTILES


def _root(url: str) -> str:
    return url.rstrip("/").removesuffix("/v1")


def detect_model(url: str, api_key: str) -> str:
    """The first model the server lists at /v1/models, else DeepInfer Gateway's default."""
    request = urllib.request.Request(_root(url) + "/v1/models", headers={"Authorization": f"Bearer {api_key}"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return str(json.load(response)["data"][0]["id"])
    except (urllib.error.URLError, OSError, ValueError, KeyError, IndexError):
        return DEFAULT_MODEL


def _synthesizer(block_size: int, tokenizer: str | None) -> PromptSynthesizer:
    from deepinfer_gateway.recipe_bridge.tokenizer import load_tokenizer

    bundle = load_tokenizer(tokenizer)
    return PromptSynthesizer(Vocabulary.from_tokenizer(bundle.tokenizer, bundle.json_text), block_size)


def _run_loop(coro: Any) -> Any:
    try:
        import uvloop

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(coro)
    except ImportError:
        return asyncio.run(coro)


class TargetUnreachable(RuntimeError):
    pass


async def _warm_up(client: ProtocolClient) -> None:
    """One tiny request before the clock starts: connection set-up and the SDK's lazy
    imports and model classes would otherwise delay the first trace requests."""
    record = RequestRecord(index=-1, arrival_s=0.0)
    await client.send(" warm up", 1, record)
    if not record.ok:
        raise TargetUnreachable(f"warm-up request failed ({record.error}): {record.detail}")


async def _replay(config: BenchConfig, trace: Trace, model: str) -> tuple[ReplayResult, TierTokens | None]:
    """Returns the replay and the gateway's per-tier token deltas over it (None if unknown)."""
    synthesizer = _synthesizer(trace.block_size, config.tokenizer)
    return await _measured(config, model, lambda client: replay(trace.requests, synthesizer.content, client,
                                                                config.replay))


async def _measured(config: BenchConfig, model: str,
                    run: Callable[[ProtocolClient], Any]) -> tuple[Any, TierTokens | None]:
    """`run(client)` between a warm-up and two scrapes of the gateway's token counters."""
    client = ProtocolClient(ClientConfig(
        url=config.url, model=model, protocol=config.protocol, api_key=config.api_key,
        max_connections=config.max_connections, request_timeout_s=config.request_timeout_s,
        ignore_eos=config.ignore_eos, lean=config.lean_client))
    try:
        await _warm_up(client)
        before = await asyncio.to_thread(gateway_metrics.scrape, _root(config.url))
        result = await run(client)
        after = await asyncio.to_thread(gateway_metrics.scrape, _root(config.url))
        return result, gateway_metrics.delta(before, after)
    finally:
        await client.aclose()


def session_texts(synthesizer: PromptSynthesizer) -> Callable[[Round, int], tuple[Turn, ...]]:
    """The turns a round appends: a first round's shared system prompt (the same text for the
    same id in every session), then its new input as a user turn (text private to the round)."""
    def texts(r: Round, index: int) -> tuple[Turn, ...]:
        user = Turn("user", synthesizer.content(TraceRequest(index, 0.0, r.new_input_tokens, r.output_tokens)))
        if r.system is None:
            return (user,)
        system_id, tokens = r.system
        blocks = -(-tokens // synthesizer.block_size)
        ids = tuple(system_id * 100_000 + b for b in range(blocks))
        return (Turn("system", synthesizer.content(TraceRequest(0, 0.0, tokens, 1, ids))), user)
    return texts


async def _replay_sessions(config: BenchConfig, trace: SessionTrace,
                           model: str) -> tuple[SessionReplayResult, TierTokens | None]:
    texts = session_texts(_synthesizer(MOONCAKE_BLOCK_TOKENS, config.tokenizer))
    replay_cfg = config.replay
    session_cfg = SessionReplayConfig(
        concurrency=replay_cfg.concurrency if replay_cfg.mode == "closed" else None, speedup=replay_cfg.speedup,
        duration_s=replay_cfg.duration_s, drain_timeout_s=replay_cfg.drain_timeout_s, progress=replay_cfg.progress,
        tool_calls=config.tool_calls)
    result: SessionReplayResult
    result, tiers = await _measured(config, model, lambda client: replay_sessions(trace, texts, client, session_cfg))
    return result, tiers


def _provenance(spec: str) -> dict[str, Any] | None:
    """Where a published trace came from (null for files and synthetic workloads)."""
    source = SOURCES.get(spec)
    if source is None:
        return None
    return {"url": source.url(), "sha256": source.sha256, "git_blob": source.git_blob, "license": source.license}


def _start(config: BenchConfig, before_run: Callable[[], None] | None) -> tuple[str, str]:
    """(the model to send, the start time) once the output directory exists and `before_run` ran."""
    model = config.model or detect_model(config.url, config.api_key)
    config.out.mkdir(parents=True, exist_ok=True)
    if before_run is not None:
        before_run()
    return model, dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


def run_bench(config: BenchConfig, before_run: Callable[[], None] | None = None) -> dict[str, Any]:
    if is_session_spec(config.trace):
        return _run_sessions(config, before_run)
    if config.tool_calls:
        raise ValueError("tool calls are replayed in session traces only")
    trace = load_trace(config.trace).head(config.max_requests)
    model, started = _start(config, before_run)
    result, tiers = _run_loop(_replay(config, trace, model))
    sent = {r.index for r in result.records}
    oracle = oracle_hit_rate([r for r in trace.requests if r.index in sent], trace.block_size)
    replay_cfg = config.replay
    meta = {
        "target": config.url, "protocol": config.protocol, "model": model, "trace": trace.name,
        "trace_requests_selected": len(trace.requests), "started_at": started,
        "trace_source": _provenance(config.trace),
        "mode": replay_cfg.mode,
        "speedup": replay_cfg.speedup if replay_cfg.mode == "open" else None,
        "concurrency": replay_cfg.concurrency if replay_cfg.mode == "closed" else None,
        "prompt_synthesis": (
            "one user message; content = input_length tokens in trace block order; the chat template "
            "adds a fixed header (28 tokens with DeepSeek-V4.1) before it and 2 tokens after"),
    }
    summary = summarize(result.records, wall_s=result.wall_s, oracle_hit_rate=oracle, slo=config.slo,
                        cost=config.cost, tiers=tiers, client_cpu_s=result.client_cpu_s,
                        synthesis_cpu_s=result.synthesis_cpu_s,
                        hit_window_s=config.hit_window_s, meta=meta, percentiles=config.percentiles)
    write_records(config.out / "results.jsonl", result.records)
    (config.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if config.plots:
        plots.ttft_cdf(result.records, config.out / "ttft_cdf.png", f"TTFT CDF: {trace.name}")
        plots.hit_rate_over_time(summary, config.out / "hit_rate.png")
    return summary


def _run_sessions(config: BenchConfig, before_run: Callable[[], None] | None) -> dict[str, Any]:
    trace = load_sessions(config.trace).head(config.max_requests)
    model, started = _start(config, before_run)
    result, tiers = _run_loop(_replay_sessions(config, trace, model))
    replay_cfg = config.replay
    meta = {
        "target": config.url, "protocol": config.protocol, "model": model, "trace": trace.name,
        "trace_requests_selected": trace.rounds, "started_at": started, "trace_source": None,
        "mode": "sessions",
        "speedup": replay_cfg.speedup,
        "concurrency": replay_cfg.concurrency if replay_cfg.mode == "closed" else None,
        "prompt_synthesis": (
            "a conversation per session: a first round's shared system prompt and input, then per round the "
            "previous round's actual answer as the assistant turn and the round's new input as a user turn"
            + ("; with tool calls: a continued round's answer is a forced call of the agent's tool, and the "
               "round continuing it sends its new input as that call's result" if config.tool_calls else "")),
        "tool_calls": config.tool_calls,
    }
    summary = summarize(result.records, wall_s=result.wall_s, slo=config.slo, cost=config.cost, tiers=tiers,
                        client_cpu_s=result.client_cpu_s, synthesis_cpu_s=result.synthesis_cpu_s,
                        hit_window_s=config.hit_window_s, meta=meta, percentiles=config.percentiles)
    summary.update(session_figures(result.records, [t.makespan_s for t in result.sessions],
                                   [t.service_s for t in result.sessions], config.percentiles))
    write_records(config.out / "results.jsonl", result.records)
    (config.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if config.plots:
        plots.ttft_cdf(result.records, config.out / "ttft_cdf.png", f"TTFT CDF: {trace.name}")
        plots.hit_rate_over_time(summary, config.out / "hit_rate.png")
        plots.by_round(summary, config.out / "by_round.png", f"sessions: {trace.name}")
    return summary
