"""Worker protocol v1: the token-level contract between the gateway and engine workers.

The only module the gateway and the workers share (see docs/worker-protocol.md, which is
the normative description; keep both in step and bump PROTOCOL_VERSION on a breaking
change).

Request bodies are validated with pydantic once per request. The streamed reply is
NDJSON: one JSON object per line, built as plain dicts by the helpers below, because
it is the per-token hot path and pydantic there would cost more than the rest of the
relay.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field

PROTOCOL_VERSION = 1
KV_BLOCK_TOKENS = 128  # DeepInfer V4.1-Flash resolved_tokens_per_block
MAX_PRIORITY = 1000  # a generate request's `priority` lies within +-this

# Paths (all HTTP/1.1 on the worker's port).
GENERATE_PATH = "/v1/worker/generate"
ABORT_PATH = "/v1/worker/abort"
LOAD_PATH = "/v1/worker/load"
KV_EVENTS_PATH = "/v1/worker/kv_events"
MAX_KV_EVENTS_WAIT_MS = 30_000  # the longest a kv_events long poll may be held (`wait_ms`)
INFO_PATH = "/v1/worker/info"
HEALTH_PATH = "/health"
# Worker protocol v2: one WebSocket per gateway and worker carrying every request
# (docs/worker-protocol.md "v2"). A worker without it answers 404 to the upgrade.
MUX_PATH = "/v2/worker/mux"
MUX_VERSION = 2
# The largest v2 message either side accepts (a bigger one closes the connection with 1009,
# failing every request on it): the gateway sends a bigger generate op over v1 instead.
MAX_MUX_MESSAGE_BYTES = 64 << 20
# The v2 upgrade's subprotocol a gateway offers when it wants the worker's KV events and
# load reports pushed on the connection; a worker that selects it serves the `*_subscribe`
# ops. Either side without it keeps v1's polls (docs/worker-protocol.md "Pushes").
MUX_PUSH_SUBPROTOCOL = "dgw.worker.v2.push"
# ASGI scope key: where a tracing middleware leaves the span factory for v2's requests
# (`(name, W3C carrier, **attributes) -> context manager`; absent: no spans).
SPANS_SCOPE_KEY = "dgw.spans"

NDJSON = "application/x-ndjson"
REQUEST_ID_HEADER = "x-request-id"

DEFAULT_MODEL = "DeepSeek-V4.1-Flash"  # the served model name when none is configured

# A request's workload class sets how long the shared KV store keeps its blocks
# (DeepSeek's production store: agent 3 days, chat 7 days).
WorkloadClass = Literal["chat", "agent"]
STORE_TTL_S: dict[str, float] = {"agent": 3 * 86_400.0, "chat": 7 * 86_400.0}


class V1Fallback(StrEnum):
    """Why a gateway that tries v2 sent a leg over v1 (its metrics' `reason`)."""

    NOT_SPOKEN = "not_spoken"  # the worker refused the v2 upgrade: it speaks v1 only
    TOO_LARGE = "too_large"  # a generate op over MAX_MUX_MESSAGE_BYTES


class Role(StrEnum):
    UNIFIED = "unified"
    PREFILL = "prefill"
    DECODE = "decode"


class Hardware(StrEnum):
    SM100 = "sm100"
    ASCEND950 = "ascend950"


class FinishReason(StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


class ErrorKind(StrEnum):
    """Why a request ended with FinishReason.ERROR; `retryable` says whether another
    worker may succeed (only meaningful before the first token reached the client)."""

    PROMPT_TOO_LONG = "prompt_too_long"  # client error
    INVALID_TOKENS = "invalid_tokens"  # client error
    INVALID_REQUEST = "invalid_request"  # client error
    RESOURCE_EXHAUSTED = "resource_exhausted"  # retryable
    STRUCTURED_OUTPUT = "structured_output"
    VISION_ENCODER = "vision_encoder"
    KV_TRANSFER = "kv_transfer"  # retryable
    ENGINE = "engine"  # retryable
    SHUTTING_DOWN = "shutting_down"  # retryable
    UNAUTHORIZED = "unauthorized"  # v2: the connection's worker token was revoked


RETRYABLE_ERRORS = frozenset(
    {ErrorKind.RESOURCE_EXHAUSTED, ErrorKind.KV_TRANSFER, ErrorKind.ENGINE, ErrorKind.SHUTTING_DOWN}
)
CLIENT_ERRORS = frozenset({ErrorKind.PROMPT_TOO_LONG, ErrorKind.INVALID_TOKENS, ErrorKind.INVALID_REQUEST})


class KvTier(StrEnum):
    MEMORY = "memory"  # the worker's own HBM/DRAM blocks
    STORE = "store"  # the shared KV store (3FS-like)


class _Model(BaseModel):
    """What a worker is asked: an unknown field is refused (nothing accepted and ignored)."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class _Report(BaseModel):
    """What a worker reports: a gateway reads a newer worker's reports and ignores the fields it
    does not know, so additive changes keep the version (docs/worker-protocol.md "Versioning")."""

    model_config = ConfigDict(extra="ignore", frozen=True)


class StructuredOutput(_Model):
    """DeepInfer `SamplingParams.so_args`."""

    schema_type: Literal["json", "regex", "ebnf", "tool_call", "tool_call_required"]
    schema_: str = Field("", alias="schema")

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class Sampling(_Model):
    """Mirrors DeepInfer `SamplingParams` (names kept)."""

    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    max_tokens: int = Field(16, ge=1)
    min_tokens: int = Field(0, ge=0)  # no EOS before this many tokens (vLLM's extension; not in DeepInfer)
    ignore_eos: bool = False
    top_logprobs: int = Field(0, ge=0, le=1000)
    logprobs: bool = False
    seq_seed: int | None = None
    so_args: StructuredOutput | None = None
    stop_token_ids: tuple[int, ...] = ()


class KvHandoff(_Model):
    """Where a decode worker finds the KV a prefill worker produced."""

    handle: str
    source_worker: str
    kv_format: str
    num_tokens: int = Field(ge=0)
    block_hashes: tuple[int, ...] = ()


class GenerateRequest(_Model):
    request_id: str = Field(min_length=1, max_length=256)
    token_ids: list[int] = Field(min_length=1)
    sampling: Sampling = Sampling()
    role: Role = Role.UNIFIED
    # Prefill role: return after the first token with a KV hand-off handle.
    # Decode role: continue from `kv_handoff`; `token_ids` is prompt + first token.
    kv_handoff: KvHandoff | None = None
    workload_class: WorkloadClass = "chat"
    # Number of image placeholder tokens beyond one per placeholder (vision encoder cost).
    image_token_adjustment: int = Field(0, ge=0)
    images: list[str] = Field(default_factory=list)  # base64 preprocessed images
    arrival_time: float | None = None
    # Prefix-cache isolation (vLLM's `cache_salt`): blocks are shared only among requests with
    # the same salt (kvcache.hashing.kv_salt); a worker that cannot isolate them refuses it.
    cache_salt: str | None = Field(None, min_length=1, max_length=256)
    # Scheduling priority (vLLM's `priority`): on a worker whose `scheduling_policy` is "priority"
    # a lower value runs first (and preempts, with `priority_preemption`); a worker scheduling
    # first come, first served refuses any value but 0.
    priority: int = Field(0, ge=-MAX_PRIORITY, le=MAX_PRIORITY)


class AbortRequest(_Model):
    request_id: str


class DpRankLoad(_Report):
    dp_rank: int
    running: int
    waiting: int
    queued_prefill_tokens: int


class LoadReport(_Report):
    worker_id: str
    role: Role
    hardware: Hardware
    kv_format: str
    running: int
    waiting: int
    queued_prefill_tokens: int
    kv_usage: float = Field(ge=0.0, le=1.0)
    memory_capacity_blocks: int
    dp_ranks: list[DpRankLoad]
    # Counters since start, for engine-side hit-rate dashboards.
    prompt_tokens_total: int = 0
    cached_tokens_total: dict[KvTier, int] = Field(default_factory=dict)
    preemptions_total: int = 0  # running requests preempted by a more urgent one (vLLM's num_preemptions)
    # Prompt tokens prefilled again because this worker had cached and evicted them: what cache
    # pressure costs (the sim reports it; 0 where an engine cannot tell).
    evicted_recomputed_tokens_total: int = 0
    epoch: str = ""


class WorkerInfo(_Report):
    protocol_version: int = PROTOCOL_VERSION
    worker_id: str
    engine: Literal["sim", "deepinfer", "vllm", "openai"]
    role: Role
    hardware: Hardware
    kv_format: str
    model: str
    dp_size: int = 1
    block_tokens: int = KV_BLOCK_TOKENS
    # Sequences one DP rank runs at once (the engine's max_num_seqs); None: not said.
    max_num_seqs: int | None = Field(None, ge=1)
    # A decode worker that can also prefill a prompt itself (PD bypass of short uncached parts).
    # DeepInfer's COMPLETION engine cannot; absent (older workers) means it can.
    prefills: bool = True
    # "priority": waiting requests run by (`priority`, arrival), as vLLM's --scheduling-policy
    # priority does (which preempts only when a running request runs out of KV); "fcfs": by
    # arrival, and a request with a non-zero `priority` is refused.
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    # With "priority": a waiting request that finds no free sequence slot (or KV) preempts the
    # running request of the highest value above its own, which is recomputed later (SGLang's
    # priority scheduling with preemption; the sim's). Flow control then lets the tiers above
    # flex start whatever flex holds.
    priority_preemption: bool = False
    epoch: str  # changes on every (re)start; a consumer seeing a new epoch drops the worker's memory tier


class KvEventKind(StrEnum):
    STORED = "stored"
    EVICTED = "evicted"
    CLEARED = "cleared"  # all blocks of `tier` are gone (worker restart)


class KvEvent(_Report):
    seq: int  # per worker, per epoch, gap-free from 1
    kind: KvEventKind
    tier: KvTier
    block_hashes: list[int] = Field(default_factory=list)
    expires_at: float | None = None  # store tier: unix time of TTL expiry


class KvEventBatch(_Report):
    worker_id: str
    epoch: str
    events: list[KvEvent]
    last_seq: int  # highest seq the worker has issued so far (gap detection)
    oldest_seq: int  # oldest seq still retained; asking for `after` < oldest_seq - 1 means resync


# --- streamed reply: one JSON object per line -------------------------------------------


def ready_event(prompt_tokens: int, cached_memory: int, cached_store: int) -> dict[str, Any]:
    return {
        "event": "ready",
        "prompt_tokens": prompt_tokens,
        "cached_tokens": {"memory": cached_memory, "store": cached_store},
    }


def tokens_event(token_ids: list[int], logprobs: list[Any] | None = None) -> dict[str, Any]:
    """`logprobs`, when asked for: one `[logprob, [[token_id, logprob], ...]]` per token."""
    event: dict[str, Any] = {"event": "tokens", "token_ids": token_ids}
    if logprobs is not None:
        event["logprobs"] = logprobs
    return event


def finish_event(
    reason: FinishReason,
    *,
    error_kind: ErrorKind | None = None,
    message: str | None = None,
    kv_handoff: KvHandoff | None = None,
    num_output_tokens: int = 0,
    cached_tokens: tuple[int, int] | None = None,
) -> dict[str, Any]:
    """`cached_tokens` (memory, store), optional: the engine's final cached count when `ready`
    carried a provisional one (engines that report it only at the end, e.g. vLLM)."""
    event: dict[str, Any] = {"event": "finish", "reason": str(reason), "num_output_tokens": num_output_tokens}
    if cached_tokens is not None:
        event["cached_tokens"] = {"memory": cached_tokens[0], "store": cached_tokens[1]}
    if error_kind is not None:
        event["error"] = {
            "kind": str(error_kind),
            "message": message or str(error_kind),
            "retryable": error_kind in RETRYABLE_ERRORS,
        }
    if kv_handoff is not None:
        event["kv_handoff"] = kv_handoff.model_dump(by_alias=True)
    return event


def encode_line(event: dict[str, Any]) -> bytes:
    return orjson.dumps(event) + b"\n"


# --- v2 messages (docs/worker-protocol.md "v2") --------------------------------------


class AbortOp(_Model):
    op: Literal["abort"]
    request_id: str = Field(min_length=1, max_length=256)


class GenerateOp(_Model):
    op: Literal["generate"]
    request: GenerateRequest
    # The caller's W3C trace context (`traceparent`, `tracestate`): v1 sends it as headers.
    trace: dict[str, str] | None = None


class KvSubscribeOp(_Model):
    """Push the KV event log from `after` on (each batch as `kv_events` tagged `sub`), at most
    one message per `interval_ms` after the first; a new one replaces the last."""

    op: Literal["kv_subscribe"]
    after: int = Field(ge=0)
    sub: int = Field(ge=0)
    interval_ms: int = Field(50, ge=0, le=MAX_KV_EVENTS_WAIT_MS)
    limit: int = Field(2000, ge=1, le=10_000)


class LoadSubscribeOp(_Model):
    """Push a `load` report now and whenever it changes, at most one per `interval_ms`."""

    op: Literal["load_subscribe"]
    interval_ms: int = Field(100, ge=10, le=10_000)


def kv_subscribe_op(after: int, sub: int, interval_ms: int, limit: int) -> dict[str, Any]:
    return {"op": "kv_subscribe", "after": after, "sub": sub, "interval_ms": interval_ms, "limit": limit}


def load_subscribe_op(interval_ms: int) -> dict[str, Any]:
    return {"op": "load_subscribe", "interval_ms": interval_ms}


def generate_op(request: dict[str, Any], trace: dict[str, str] | None = None) -> dict[str, Any]:
    """A v2 `generate` op carrying a `GenerateRequest` body (the gateway's side: plain dicts)."""
    op = {"op": "generate", "request": request}
    if trace:
        op["trace"] = trace
    return op


def abort_op(request_id: str) -> dict[str, Any]:
    return {"op": "abort", "request_id": request_id}
