"""Any OpenAI-compatible server as a worker: the worker protocol over `/v1/completions` with text.

For servers that cannot take or return token ids (`engine = "openai"`). The gateway renders
and tokenizes as for any worker; this adapter sends the rendered prompt as TEXT (the prompt's
ids decoded with the gateway's tokenizer, special-token spellings included) and turns the
streamed text back into ids with the same tokenizer (`TextTokens`), so the response path
(reasoning, DSML tool calls, stop sequences, usage) is the one every worker feeds. The ids
are a re-tokenization: their count can differ by a few from what the server generated.

The server must run the gateway's model and tokenizer. Two extension fields are always sent,
because the DeepSeek template depends on them: `add_special_tokens: false` (the rendered
prompt already holds its BOS) and `skip_special_tokens: false` (reasoning and DSML markers
must come back as text). vLLM and SGLang take both; servers that reject unknown fields do not fit.

Routing: such a server publishes no KV events, so the prefix index never holds its blocks;
put these workers in a pool routed by `prefix_approx` (the gateway's own routing history).

Counts: the cached count arrives only with the final usage (as on vLLM). A request is ONE
streamed call: `ready` goes out with the first chunk, with the gateway's prompt count and a
provisional cached count (the router's predicted overlap, completions_api.provisional_cached;
such servers publish no KV events: it is the routing history's guess, or 0), and the server's real
count rides on `finish` (`cached_tokens`); the response path corrects every usage reported at
the end. A server that reports no cached count leaves the provisional figure standing.

Health, model, context length: `/v1/models` (`max_model_len` when the server reports one).
Load: `/metrics` when the server exports vLLM's gauges (running, waiting, KV usage, process
start as the epoch), else zeros (the router still counts this gateway's own open calls).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from deepinfer_gateway.config import OpenAIWorkerSpec
from deepinfer_gateway.core import protocol as wp
from deepinfer_gateway.core.errors import UpstreamError, UpstreamKind
from deepinfer_gateway.gateway.upstream.base import LegRequest, Probe
from deepinfer_gateway.gateway.upstream.completions_api import (
    CompletionStream,
    fit_to_context,
    probe_server,
    provisional_cached,
    refusal,
)
from deepinfer_gateway.gateway.upstream.http import HttpPool
from deepinfer_gateway.gateway.upstream.text_tokens import TextTokens
from deepinfer_gateway.recipe_bridge.detokenizer import token_bytes
from deepinfer_gateway.recipe_bridge.tokenizer import TokenizerBundle


def openai_kv_format(model: str) -> str:
    """No KV compatibility is known between such servers: one format per served model."""
    return f"openai:{model}"


@dataclass(frozen=True)
class OpenAIFacts:
    """What one probe of an OpenAI-compatible server found."""

    model: str
    max_model_len: int
    running: int
    waiting: int
    kv_usage: float
    started_at: str  # "" when the server exports no process start time

    def info(self, spec: OpenAIWorkerSpec) -> wp.WorkerInfo:
        return wp.WorkerInfo(worker_id=spec.worker_id, engine="openai", role=spec.role, hardware=spec.hardware,
                             kv_format=spec.kv_format or openai_kv_format(self.model), model=self.model,
                             block_tokens=wp.KV_BLOCK_TOKENS, epoch=self.started_at)

    def load(self, spec: OpenAIWorkerSpec) -> wp.LoadReport:
        return wp.LoadReport(worker_id=spec.worker_id, role=spec.role, hardware=spec.hardware,
                             kv_format=spec.kv_format or openai_kv_format(self.model),
                             running=self.running, waiting=self.waiting, queued_prefill_tokens=0,
                             kv_usage=min(1.0, max(0.0, self.kv_usage)), memory_capacity_blocks=0, dp_ranks=[],
                             epoch=self.started_at)


async def probe(http: HttpPool, spec: OpenAIWorkerSpec) -> OpenAIFacts:
    """`/v1/models` (required) and `/metrics` (optional); a failure of the former is an UpstreamError."""
    server = await probe_server(http, spec, metrics_required=False)
    start = server.gauges.get("process_start_time_seconds")
    return OpenAIFacts(
        model=server.model, max_model_len=server.max_model_len, running=server.running, waiting=server.waiting,
        kv_usage=server.kv_usage, started_at=repr(start) if start is not None else "",
    )


def completion_body(model: str, prompt: str, sampling: dict[str, Any], max_tokens: int,
                    stop: list[str], cache_salt: str | None = None) -> dict[str, Any]:
    """The `/v1/completions` body (`sampling` as the worker body carries it: non-default fields only)."""
    body: dict[str, Any] = {
        "model": model, "prompt": prompt, "max_tokens": max_tokens,
        "temperature": sampling.get("temperature", 1.0), "top_p": sampling.get("top_p", 1.0),
        "stream": True, "stream_options": {"include_usage": True},
        "add_special_tokens": False, "skip_special_tokens": False,
    }
    if sampling.get("top_k", -1) > 0:
        body["top_k"] = sampling["top_k"]
    if sampling.get("ignore_eos"):
        body["ignore_eos"] = True
    if sampling.get("min_tokens"):
        body["min_tokens"] = sampling["min_tokens"]  # a server without it refuses: the client gets its 400
    if sampling.get("seq_seed") is not None:
        body["seed"] = sampling["seq_seed"]
    if stop:
        body["stop"] = stop
    so_args = sampling.get("so_args") or {}
    if so_args.get("schema_type") == "json":
        schema = so_args.get("schema", "")
        body["response_format"] = ({"type": "json_schema", "json_schema": {"name": "answer",
                                                                            "schema": orjson.loads(schema)}}
                                   if schema else {"type": "json_object"})
    elif so_args.get("schema_type") == "regex":
        body["structured_outputs"] = {"regex": so_args.get("schema", "")}  # vLLM's name; DSML grammars: none
    if cache_salt is not None:
        body["cache_salt"] = cache_salt  # vLLM's name; a server without it must refuse it (docs/real-engines.md)
    return body


class OpenAIStream(CompletionStream):
    """One worker-protocol request on an OpenAI-compatible server: one streamed call (module doc)."""

    def __init__(self, url: str, prompt_tokens: int, tokens: TextTokens, *, provisional_cached: int = 0):
        super().__init__(url, prompt_tokens, provisional_cached)
        self._tokens = tokens

    def _choice(self, choice: dict[str, Any]) -> None:
        self._emit(self._tokens.push(choice.get("text") or ""))

    def _tail(self) -> None:
        self._emit(self._tokens.flush())


class OpenAIUpstream:
    """One OpenAI-compatible worker: its last probed facts, and requests on it. Whole requests
    only (no PD), and no KV events."""

    handoff_family = "openai"

    reports_queue = False

    def __init__(self, spec: OpenAIWorkerSpec, http: HttpPool, bundle: TokenizerBundle):
        self.spec = spec
        self.facts: OpenAIFacts | None = None
        self._http = http
        self._bundle = bundle
        self._text = token_bytes(bundle.json_text)

    async def probe(self, known: wp.WorkerInfo | None = None) -> Probe:
        """One probe gives both reports."""
        self.facts = facts = await probe(self._http, self.spec)
        return Probe(facts.info(self.spec), facts.load(self.spec))

    async def abort(self, request_id: str) -> None:
        """The dropped connection is the abort (no such endpoint in the API)."""

    def retire(self) -> None:
        """Nothing to let go of: pooled HTTP connections idle out."""

    def kv_source(self) -> None:
        return None

    async def generate(self, leg: LegRequest) -> OpenAIStream:
        facts = self.facts
        if facts is None:
            raise UpstreamError(UpstreamKind.CONNECT, f"{self.spec.url} not probed yet")
        sampling = leg.sampling
        token_ids = leg.token_ids
        max_tokens, refused = fit_to_context(len(token_ids), sampling.get("max_tokens", 16), facts.max_model_len)
        if leg.role != wp.Role.UNIFIED or leg.kv_handoff:
            refused = refusal(wp.ErrorKind.INVALID_REQUEST, "an openai worker serves whole requests only")
        elif leg.images:
            refused = refusal(wp.ErrorKind.INVALID_REQUEST, "images are not sent to openai workers", retryable=True)
        elif sampling.get("logprobs"):  # the server's are per its text pieces, not per the gateway's ids
            refused = refusal(wp.ErrorKind.INVALID_REQUEST, "openai workers give no token-id logprobs",
                               retryable=True)
        stop = [self._text.text_of(t) for t in sampling.get("stop_token_ids") or ()]
        stream = OpenAIStream(self.spec.url, len(token_ids), TextTokens(self._bundle),
                              provisional_cached=provisional_cached(leg.predicted_cached, len(token_ids), 0))
        if refused is not None:
            stream.refuse(refused)
        else:
            await stream.start(self._http, leg.request_id,
                               completion_body(facts.model, self._text.decode(token_ids), sampling, max_tokens, stop,
                                               leg.cache_salt))
        return stream
