"""A vLLM OpenAI server as a worker: the worker protocol over `/v1/completions` with token ids.

The gateway renders and tokenizes as for any worker and sends the prompt's token ids
(`prompt: [ids]`), so routing hashes, vLLM's prefix cache and its KV events see the same
tokens; `return_token_ids` brings the output back as ids, which the response path turns
into the client's protocol exactly as for sim workers. `VllmStream` yields worker-protocol
events (`ready`, `tokens`, `finish`), so legs and relay do not know which engine served.

Counts: vLLM reports `prompt_tokens_details.cached_tokens` only in its final usage chunk.
A request is ONE streamed call: `ready` goes out with the first chunk (the first token) with
the prompt's length and a provisional cached count, the router's predicted overlap for this
worker (`provisional_cached`: with KV events the index holds vLLM's cached blocks, so it is
usually exact); vLLM's real count rides on `finish` (`cached_tokens`, docs/worker-protocol.md)
and the response path corrects every usage it reports at the end (recipe_bridge/stream.py).
A server started without `--enable-prompt-tokens-details` reports none: the provisional
figure stands.

PD roles (vllm_pd.py): a prefill leg is one non-streamed `max_tokens: 1` call asking for a
remote decode; its answer's `kv_transfer_params` become the hand-off. A decode leg is one
streamed call with them (the client's usage comes from the prefill leg: its `finish` carries
no cached count).

Health, model, context length and load: `/v1/models` (model, `max_model_len`) and the
Prometheus `/metrics` (`vllm:num_requests_running`, `vllm:num_requests_waiting`,
`vllm:kv_cache_usage_perc`, `vllm:cache_config_info{block_size}`, `process_start_time_seconds`
as the epoch) become the registry's `WorkerInfo` and `LoadReport`.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from deepinfer_gateway import protocol as wp
from deepinfer_gateway.config import WorkerSpec
from deepinfer_gateway.errors import UpstreamError, UpstreamKind
from deepinfer_gateway.gateway import vllm_pd
from deepinfer_gateway.gateway.completions_api import (
    CompletionStream,
    fit_to_context,
    post_completion,
    probe_server,
    refusal,
)
from deepinfer_gateway.gateway.worker_client import EventStream, Timeouts

# The router's predicted cached prompt tokens, added by legs.py to the body of in-process
# adapters only (this and openai_upstream.py): the wire protocol's request has no such field.
PREDICTED_CACHED = "predicted_cached_tokens"
_TOKEN_ID = re.compile(r"token_id:(-?\d+)")


def vllm_kv_format(model: str, block_size: int) -> str:
    """The KV format of a vLLM worker (its KV is compatible only with the same model and block size)."""
    return f"vllm:{model}:{block_size}"


@dataclass(frozen=True)
class VllmFacts:
    """What one probe of a vLLM server found."""

    model: str
    max_model_len: int
    block_size: int
    running: int
    waiting: int
    kv_usage: float
    started_at: str  # process start time: a new value means a new process (empty cache)

    def info(self, spec: WorkerSpec) -> wp.WorkerInfo:
        return wp.WorkerInfo(worker_id=spec.worker_id, engine="vllm", role=spec.role, hardware=spec.hardware,
                             kv_format=spec.kv_format or vllm_kv_format(self.model, self.block_size),
                             model=self.model, block_tokens=self.block_size, epoch=self.started_at)

    def load(self, spec: WorkerSpec) -> wp.LoadReport:
        return wp.LoadReport(worker_id=spec.worker_id, role=spec.role, hardware=spec.hardware,
                             kv_format=spec.kv_format or vllm_kv_format(self.model, self.block_size),
                             running=self.running, waiting=self.waiting,
                             queued_prefill_tokens=0,  # vLLM exports no queued prompt tokens; see `waiting`
                             kv_usage=min(1.0, max(0.0, self.kv_usage)), memory_capacity_blocks=0, dp_ranks=[],
                             epoch=self.started_at)


async def probe(session: aiohttp.ClientSession, spec: WorkerSpec, timeout_s: float) -> VllmFacts:
    """Read a vLLM server's model list and metrics; any failure is an UpstreamError."""
    server = await probe_server(session, spec, timeout_s, metrics_required=True)
    return VllmFacts(
        model=server.model, max_model_len=server.max_model_len, block_size=server.block_size,
        running=server.running, waiting=server.waiting, kv_usage=server.kv_usage,
        started_at=repr(server.gauges.get("process_start_time_seconds", 0.0)),
    )


def completion_body(model: str, token_ids: list[int], sampling: dict[str, Any], max_tokens: int) -> dict[str, Any]:
    """The `/v1/completions` body for a worker-protocol request (`sampling` as the worker
    body carries it: non-default fields only)."""
    body: dict[str, Any] = {
        "model": model, "prompt": token_ids, "max_tokens": max_tokens,
        "temperature": sampling.get("temperature", 1.0), "top_p": sampling.get("top_p", 1.0),
        "return_token_ids": True, "stream": True, "stream_options": {"include_usage": True},
    }
    if sampling.get("top_k", -1) > 0:
        body["top_k"] = sampling["top_k"]
    if sampling.get("ignore_eos"):
        body["ignore_eos"] = True
    if sampling.get("min_tokens"):
        body["min_tokens"] = sampling["min_tokens"]
    if sampling.get("seq_seed") is not None:
        body["seed"] = sampling["seq_seed"]
    if sampling.get("stop_token_ids"):
        body["stop_token_ids"] = list(sampling["stop_token_ids"])
    if sampling.get("logprobs"):
        body["logprobs"] = sampling.get("top_logprobs", 0)
        body["return_tokens_as_token_ids"] = True  # top candidates keyed "token_id:N", not text
    structured = _structured_outputs(sampling.get("so_args"))
    if structured is not None:
        body["structured_outputs"] = structured
    return body


def _structured_outputs(so_args: dict[str, Any] | None) -> dict[str, Any] | None:
    """DeepInfer's so_args as vLLM's structured outputs; DSML tool-call grammars have no vLLM
    equivalent and are not forwarded (the gateway still parses the calls)."""
    if not so_args:
        return None
    kind, schema = so_args.get("schema_type"), so_args.get("schema", "")
    if kind == "json":
        return {"json": orjson.loads(schema)} if schema else {"json_object": True}
    if kind == "regex":
        return {"regex": schema}
    if kind == "ebnf":
        return {"grammar": schema}
    return None


def _logprobs(choice: dict[str, Any]) -> list[Any] | None:
    """vLLM's completion logprobs as the worker protocol's `[logprob, [[id, logprob], ...]]` per token."""
    lp = choice.get("logprobs")
    if not lp:
        return None
    out = []
    for logprob, top in zip(lp.get("token_logprobs") or [], lp.get("top_logprobs") or [], strict=False):
        pairs = [[int(m.group(1)), float(v)] for k, v in (top or {}).items() if (m := _TOKEN_ID.fullmatch(k))]
        out.append([float(logprob if logprob is not None else 0.0), pairs])
    return out


def provisional_cached(body: dict[str, Any], prompt_tokens: int, block_size: int) -> int:
    """`ready`'s cached count before vLLM reports its own: the router's predicted overlap
    (`body[PREDICTED_CACHED]`; with KV events, vLLM's cached full blocks), cut as vLLM cuts a
    hit (whole blocks, at least the last prompt token computed)."""
    predicted = int(body.get(PREDICTED_CACHED) or 0)
    limit = prompt_tokens - 1
    if block_size > 0:
        limit = limit // block_size * block_size
    return max(0, min(predicted, limit))


class VllmStream(CompletionStream):
    """One worker-protocol request on vLLM: one streamed completion call (see the module doc).
    A PD decode leg (vllm_pd.py) sends the prefill's kv_transfer_params, and its `ready` needs
    no counts (the client's usage comes from the prefill leg)."""

    def __init__(self, url: str, prompt_tokens: int, *, provisional_cached: int = 0, decode: bool = False):
        super().__init__(url, prompt_tokens, provisional_cached)
        self._decode = decode

    async def start(self, session: aiohttp.ClientSession, request_id: str, body: dict[str, Any],
                    timeouts: Timeouts) -> None:
        if self._decode:
            self._events.append(wp.ready_event(self._prompt_tokens, 0, 0))
            self._ready = True
        await super().start(session, request_id, body, timeouts)

    def _choice(self, choice: dict[str, Any]) -> None:
        ids = choice.get("token_ids") or []
        if choice.get("finish_reason") == "stop" and ids and not isinstance(choice.get("stop_reason"), str):
            ids = ids[:-1]  # the stop token (EOS or a stop token id) is not streamed
        self._emit(ids, _logprobs(choice) if ids else None)

    def _final_cached(self, usage: dict[str, Any]) -> int | None:
        return None if self._decode else super()._final_cached(usage)


async def read_answer(response: aiohttp.ClientResponse, url: str, timeout_s: float) -> Any:
    """A non-streamed answer's JSON; the connection is dropped (vLLM aborts) if the wait is cut short."""
    try:
        async with asyncio.timeout(timeout_s):
            raw = await response.read()
    except TimeoutError:
        response.close()
        raise UpstreamError(UpstreamKind.TIMEOUT, f"vLLM {url} sent no answer within {timeout_s:.0f} s") from None
    except (aiohttp.ClientError, ConnectionError, OSError) as exc:
        response.close()
        raise UpstreamError(UpstreamKind.DISCONNECT, f"connection to {url} broke: {exc}") from None
    except BaseException:  # cancelled: the client went away
        response.close()
        raise
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise UpstreamError(UpstreamKind.PROTOCOL, f"vLLM {url} sent malformed JSON: {raw[:80]!r}") from None


class VllmUpstream:
    """One vLLM worker: its last probed facts, and requests on it."""

    def __init__(self, spec: WorkerSpec):
        self.spec = spec
        self.facts: VllmFacts | None = None

    async def probe(self, session: aiohttp.ClientSession, timeout_s: float) -> VllmFacts:
        self.facts = await probe(session, self.spec, timeout_s)
        return self.facts

    async def generate(self, session: aiohttp.ClientSession, body: dict[str, Any], request_id: str,
                       timeouts: Timeouts) -> EventStream:
        facts = self.facts
        if facts is None:
            raise UpstreamError(UpstreamKind.CONNECT, f"vLLM {self.spec.url} not probed yet")
        sampling = body.get("sampling") or {}
        token_ids = body["token_ids"]
        max_tokens, refused = fit_to_context(len(token_ids), sampling.get("max_tokens", 16), facts.max_model_len)
        role, handoff = body.get("role", "unified"), body.get("kv_handoff")
        transfer = None
        if body.get("images"):
            refused = refusal(wp.ErrorKind.INVALID_REQUEST, "images are not sent to vLLM workers", retryable=True)
        elif role == "decode" and handoff:
            try:
                transfer = vllm_pd.transfer_of(handoff)
            except ValueError as exc:
                refused = refusal(wp.ErrorKind.INVALID_REQUEST, str(exc))
        elif role not in ("unified", "prefill") or handoff:
            refused = refusal(wp.ErrorKind.INVALID_REQUEST, "a vLLM decode leg needs a KV hand-off")
        if role == "prefill":
            return vllm_pd.HeldEvents([refused]) if refused else await self._prefill(session, facts, token_ids,
                                                                                       sampling, request_id, timeouts)
        stream = VllmStream(self.spec.url, len(token_ids), decode=role == "decode",
                            provisional_cached=provisional_cached(body, len(token_ids), facts.block_size))
        if refused is not None:
            stream.refuse(refused)
            return stream
        request = completion_body(facts.model, token_ids, sampling, max_tokens)
        if role == "decode":
            request = vllm_pd.decode_body(request, transfer)
        await stream.start(session, request_id, request, timeouts)
        return stream

    async def _prefill(self, session: aiohttp.ClientSession, facts: VllmFacts, token_ids: list[int],
                       sampling: dict[str, Any], request_id: str, timeouts: Timeouts) -> EventStream:
        """A PD prefill leg (vllm_pd.py): one non-streamed call, its events held."""
        url = self.spec.url
        body = vllm_pd.prefill_body(completion_body(facts.model, token_ids, sampling, 1))
        answer = await read_answer(await post_completion(session, url, request_id, body), url, timeouts.first_event_s)
        try:
            events = vllm_pd.prefill_events(answer, self.spec.worker_id, facts.info(self.spec).kv_format)
        except ValueError as exc:
            raise UpstreamError(UpstreamKind.PROTOCOL, f"vLLM {url} prefill answer: {exc}") from None
        return vllm_pd.HeldEvents(events)
