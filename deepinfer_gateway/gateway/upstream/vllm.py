"""A vLLM OpenAI server as a worker: the worker protocol over `/v1/completions` with token ids.

The gateway renders and tokenizes as for any worker and sends the prompt's token ids
(`prompt: [ids]`), so routing hashes, vLLM's prefix cache and its KV events see the same
tokens; `return_token_ids` brings the output back as ids, which the response path turns
into the client's protocol exactly as for sim workers. `VllmStream` yields worker-protocol
events (`ready`, `tokens`, `finish`), so legs and relay do not know which engine served.

Counts: vLLM reports `prompt_tokens_details.cached_tokens` only in its final usage chunk.
A request is ONE streamed call: `ready` goes out with the first chunk (the first token) with
the prompt's length and a provisional cached count, the router's predicted overlap for this
worker (`LegRequest.predicted_cached`: with KV events the index holds vLLM's cached blocks, so it is
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

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from deepinfer_gateway.config import VllmWorkerSpec
from deepinfer_gateway.core import protocol as wp
from deepinfer_gateway.core.errors import UpstreamError, UpstreamKind
from deepinfer_gateway.gateway.upstream import vllm_pd
from deepinfer_gateway.gateway.upstream.base import EventStream, LegRequest, Probe
from deepinfer_gateway.gateway.upstream.completions_api import (
    CompletionStream,
    fit_to_context,
    post_completion,
    probe_server,
    provisional_cached,
    refusal,
)
from deepinfer_gateway.gateway.upstream.http import HttpPool, read_body
from deepinfer_gateway.kvcache.events import ZmqKvPublisher
from deepinfer_gateway.kvcache.hashing import kv_salt

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

    def info(self, spec: VllmWorkerSpec) -> wp.WorkerInfo:
        return wp.WorkerInfo(worker_id=spec.worker_id, engine="vllm", role=spec.role, hardware=spec.hardware,
                             kv_format=spec.kv_format or vllm_kv_format(self.model, self.block_size),
                             model=self.model, block_tokens=self.block_size,
                             scheduling_policy=spec.scheduling_policy, epoch=self.started_at)

    def load(self, spec: VllmWorkerSpec) -> wp.LoadReport:
        return wp.LoadReport(worker_id=spec.worker_id, role=spec.role, hardware=spec.hardware,
                             kv_format=spec.kv_format or vllm_kv_format(self.model, self.block_size),
                             running=self.running, waiting=self.waiting,
                             queued_prefill_tokens=0,  # vLLM exports no queued prompt tokens; see `waiting`
                             kv_usage=min(1.0, max(0.0, self.kv_usage)), memory_capacity_blocks=0, dp_ranks=[],
                             epoch=self.started_at)


async def probe(http: HttpPool, spec: VllmWorkerSpec) -> VllmFacts:
    """Read a vLLM server's model list and metrics; any failure is an UpstreamError."""
    server = await probe_server(http, spec, metrics_required=True)
    return VllmFacts(
        model=server.model, max_model_len=server.max_model_len, block_size=server.block_size,
        running=server.running, waiting=server.waiting, kv_usage=server.kv_usage,
        started_at=repr(server.gauges.get("process_start_time_seconds", 0.0)),
    )


def completion_body(model: str, token_ids: Sequence[int], sampling: dict[str, Any], max_tokens: int,
                    cache_salt: str | None = None, priority: int = 0) -> dict[str, Any]:
    """The `/v1/completions` body for a worker-protocol request (`sampling` as the worker
    body carries it: non-default fields only; `cache_salt`, `priority`: the request's, vLLM's
    own fields; `priority` only matters to a server started with `--scheduling-policy priority`)."""
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
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    if priority:
        body["priority"] = priority
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


class VllmStream(CompletionStream):
    """One worker-protocol request on vLLM: one streamed completion call (see the module doc).
    A PD decode leg (vllm_pd.py) sends the prefill's kv_transfer_params, and its `ready` needs
    no counts (the client's usage comes from the prefill leg)."""

    def __init__(self, url: str, prompt_tokens: int, *, provisional_cached: int = 0, decode: bool = False):
        super().__init__(url, prompt_tokens, provisional_cached)
        self._decode = decode

    async def start(self, http: HttpPool, request_id: str, body: dict[str, Any]) -> None:
        if self._decode:
            self._events.append(wp.ready_event(self._prompt_tokens, 0, 0))
            self._ready = True
        await super().start(http, request_id, body)

    def _choice(self, choice: dict[str, Any]) -> None:
        ids = choice.get("token_ids") or []
        if choice.get("finish_reason") == "stop" and ids and not isinstance(choice.get("stop_reason"), str):
            ids = ids[:-1]  # the stop token (EOS or a stop token id) is not streamed
        self._emit(ids, _logprobs(choice) if ids else None)

    def _final_cached(self, usage: dict[str, Any]) -> int | None:
        return None if self._decode else super()._final_cached(usage)


async def read_answer(http: HttpPool, url: str, request_id: str, body: dict[str, Any]) -> Any:
    """A non-streamed call's JSON answer; the connection is dropped (vLLM aborts) if the wait is cut short."""
    response = await post_completion(http, url, request_id, body)
    raw = await read_body(response, f"vLLM {url}", http.timeouts.first_event_s)
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise UpstreamError(UpstreamKind.PROTOCOL, f"vLLM {url} sent malformed JSON: {raw[:80]!r}") from None


class VllmUpstream:
    """One vLLM worker: its last probed facts, and requests on it. PD hand-offs run between
    vLLM workers only (vllm_pd.py: vLLM's `kv_transfer_params`)."""

    handoff_family = "vllm"

    reports_queue = False  # vLLM exports no queued prompt-token count

    def __init__(self, spec: VllmWorkerSpec, http: HttpPool):
        self.spec = spec
        self.facts: VllmFacts | None = None
        self._http = http

    async def probe(self, known: wp.WorkerInfo | None = None) -> Probe:
        """One probe gives both reports."""
        self.facts = facts = await probe(self._http, self.spec)
        return Probe(facts.info(self.spec), facts.load(self.spec))

    async def abort(self, request_id: str) -> None:
        """vLLM has no abort endpoint: the dropped connection is its abort."""

    def retire(self) -> None:
        """Nothing to let go of: pooled HTTP connections idle out."""

    def kv_source(self) -> ZmqKvPublisher | None:
        spec = self.spec
        if not spec.kv_events_endpoint:
            return None
        return ZmqKvPublisher(spec.kv_events_endpoint, spec.kv_events_replay_endpoint, spec.kv_events_topic,
                              self.kv_salt)

    async def kv_salt(self) -> bytes:
        """The salt of its block hashes, as the router computes it from its info."""
        info = (await probe(self._http, self.spec)).info(self.spec)
        return kv_salt(info.model, info.kv_format)

    async def generate(self, leg: LegRequest) -> EventStream:
        facts = self.facts
        if facts is None:
            raise UpstreamError(UpstreamKind.CONNECT, f"vLLM {self.spec.url} not probed yet")
        sampling = leg.sampling
        token_ids = leg.token_ids
        max_tokens, refused = fit_to_context(len(token_ids), sampling.get("max_tokens", 16), facts.max_model_len)
        role, handoff = leg.role, leg.kv_handoff
        transfer = None
        if leg.images:
            refused = refusal(wp.ErrorKind.INVALID_REQUEST, "images are not sent to vLLM workers", retryable=True)
        elif role == wp.Role.DECODE and handoff:
            try:
                transfer = vllm_pd.transfer_of(handoff)
            except ValueError as exc:
                refused = refusal(wp.ErrorKind.INVALID_REQUEST, str(exc))
        elif role not in (wp.Role.UNIFIED, wp.Role.PREFILL) or handoff:
            refused = refusal(wp.ErrorKind.INVALID_REQUEST, "a vLLM decode leg needs a KV hand-off")
        if role == wp.Role.PREFILL:
            return vllm_pd.HeldEvents([refused]) if refused else await self._prefill(facts, leg)
        stream = VllmStream(self.spec.url, len(token_ids), decode=role == wp.Role.DECODE,
                            provisional_cached=provisional_cached(leg.predicted_cached, len(token_ids),
                                                                  facts.block_size))
        if refused is not None:
            stream.refuse(refused)
            return stream
        request = completion_body(facts.model, token_ids, sampling, max_tokens, leg.cache_salt, self._priority(leg))
        if role == wp.Role.DECODE:
            request = vllm_pd.decode_body(request, transfer)
        await stream.start(self._http, leg.request_id, request)
        return stream

    def _priority(self, leg: LegRequest) -> int:
        """The leg's priority where the server schedules by it (its entry says so), else 0."""
        return leg.priority if self.spec.scheduling_policy == "priority" else 0

    async def _prefill(self, facts: VllmFacts, leg: LegRequest) -> EventStream:
        """A PD prefill leg (vllm_pd.py): one non-streamed call, its events held."""
        url = self.spec.url
        body = vllm_pd.prefill_body(completion_body(facts.model, leg.token_ids, leg.sampling, 1, leg.cache_salt,
                                                    self._priority(leg)))
        answer = await read_answer(self._http, url, leg.request_id, body)
        try:
            events = vllm_pd.prefill_events(answer, self.spec.worker_id, facts.info(self.spec).kv_format)
        except ValueError as exc:
            raise UpstreamError(UpstreamKind.PROTOCOL, f"vLLM {url} prefill answer: {exc}") from None
        return vllm_pd.HeldEvents(events)
