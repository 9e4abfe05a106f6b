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
provisional cached count (the router's predicted overlap, vllm_upstream.provisional_cached;
such servers publish no KV events: it is the routing history's guess, or 0), and the server's real
count rides on `finish` (`cached_tokens`); the response path corrects every usage reported at
the end. A server that reports no cached count leaves the provisional figure standing.

Health, model, context length: `/v1/models` (`max_model_len` when the server reports one).
Load: `/metrics` when the server exports vLLM's gauges (running, waiting, KV usage, process
start as the epoch), else zeros (the router still counts this gateway's own open calls).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from deepinfer_gateway import protocol as wp
from deepinfer_gateway import tracing
from deepinfer_gateway.config import WorkerSpec
from deepinfer_gateway.errors import UpstreamError, UpstreamKind
from deepinfer_gateway.gateway.text_tokens import TextTokens
from deepinfer_gateway.gateway.vllm_upstream import (
    COMPLETIONS_PATH,
    METRICS_PATH,
    MODELS_PATH,
    parse_metrics,
    provisional_cached,
)
from deepinfer_gateway.gateway.worker_client import LineStream, Timeouts
from deepinfer_gateway.recipe_bridge.detokenizer import token_bytes
from deepinfer_gateway.recipe_bridge.tokenizer import TokenizerBundle

_DONE = b"[DONE]"


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

    def info(self, spec: WorkerSpec) -> wp.WorkerInfo:
        return wp.WorkerInfo(worker_id=spec.worker_id, engine="openai", role=spec.role, hardware=spec.hardware,
                             kv_format=spec.kv_format or openai_kv_format(self.model), model=self.model,
                             block_tokens=wp.KV_BLOCK_TOKENS, epoch=self.started_at)

    def load(self, spec: WorkerSpec) -> wp.LoadReport:
        return wp.LoadReport(worker_id=spec.worker_id, role=spec.role, hardware=spec.hardware,
                             kv_format=spec.kv_format or openai_kv_format(self.model),
                             running=self.running, waiting=self.waiting, queued_prefill_tokens=0,
                             kv_usage=min(1.0, max(0.0, self.kv_usage)), memory_capacity_blocks=0, dp_ranks=[],
                             epoch=self.started_at)


async def probe(session: aiohttp.ClientSession, spec: WorkerSpec, timeout_s: float) -> OpenAIFacts:
    """`/v1/models` (required) and `/metrics` (optional); a failure of the former is an UpstreamError."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    try:
        async with session.get(spec.url + MODELS_PATH, timeout=timeout) as r:
            if r.status != 200:
                raise UpstreamError(UpstreamKind.HTTP_STATUS, f"{spec.url}{MODELS_PATH} answered {r.status}",
                                    status=r.status)
            models = orjson.loads(await r.read())["data"]
        async with session.get(spec.url + METRICS_PATH, timeout=timeout) as r:
            metrics = (await r.read()).decode(errors="replace") if r.status == 200 else ""
    except TimeoutError:
        raise UpstreamError(UpstreamKind.TIMEOUT, f"{spec.url} timed out") from None
    except (aiohttp.ClientError, OSError) as exc:
        raise UpstreamError(UpstreamKind.CONNECT, f"{spec.url}: {exc}") from None
    except (orjson.JSONDecodeError, KeyError, TypeError):
        raise UpstreamError(UpstreamKind.PROTOCOL, f"{spec.url}{MODELS_PATH} returned no model list") from None
    model = next((m for m in models if isinstance(m, dict) and (not spec.model or m.get("id") == spec.model)), None)
    if model is None or not isinstance(model.get("id"), str):
        raise UpstreamError(UpstreamKind.PROTOCOL, f"{spec.url} does not serve model {spec.model or '(any)'}")
    gauges, _block_size = parse_metrics(metrics)
    start = gauges.get("process_start_time_seconds")
    return OpenAIFacts(
        model=model["id"], max_model_len=int(model.get("max_model_len") or 0),
        running=int(gauges.get("vllm:num_requests_running", 0)),
        waiting=int(gauges.get("vllm:num_requests_waiting", 0)),
        kv_usage=gauges.get("vllm:kv_cache_usage_perc", 0.0),
        started_at=repr(start) if start is not None else "",
    )


def completion_body(model: str, prompt: str, sampling: dict[str, Any], max_tokens: int,
                    stop: list[str]) -> dict[str, Any]:
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
    return body


def _refusal(kind: wp.ErrorKind, message: str, *, retryable: bool | None = None) -> dict[str, Any]:
    event = wp.finish_event(wp.FinishReason.ERROR, error_kind=kind, message=message)
    if retryable is not None:
        event["error"]["retryable"] = retryable
    return event


def _status_error(url: str, status: int, raw: bytes) -> UpstreamError:
    """400/422: the request's fault (not retried, not a health failure); others go elsewhere."""
    try:
        error = orjson.loads(raw).get("error", {})
        message = error.get("message", "") if isinstance(error, dict) else str(error)
    except (orjson.JSONDecodeError, AttributeError):
        message = raw[:300].decode(errors="replace")
    if status in (400, 422):
        return UpstreamError(UpstreamKind.WORKER_ERROR, f"{url} refused the request: {message}",
                             retryable=False, status=400, detail=message)
    return UpstreamError(UpstreamKind.HTTP_STATUS, f"{url} answered {status}: {message}",
                         retryable=status >= 500 or status == 429, status=status, detail=message)


class OpenAIStream:
    """One worker-protocol request on an OpenAI-compatible server: one streamed call (module doc)."""

    def __init__(self, session: aiohttp.ClientSession, url: str, request_id: str, model: str, prompt: str,
                 prompt_tokens: int, sampling: dict[str, Any], max_tokens: int, stop: list[str],
                 tokens: TextTokens, timeouts: Timeouts, *, provisional_cached: int = 0):
        self._session = session
        self._url = url
        self._request_id = request_id
        self._model = model
        self._prompt = prompt
        self._prompt_tokens = prompt_tokens
        self._sampling = sampling
        self._max_tokens = max_tokens
        self._stop = stop
        self._tokens = tokens
        self._timeouts = timeouts
        self._line: LineStream | None = None
        self._events: deque[dict[str, Any]] = deque()
        self._provisional = provisional_cached  # `ready`'s cached count; the server's real one comes with `finish`
        self._ready = False
        self._done = False
        self._sent = 0  # output token ids emitted

    async def open(self, refusal: dict[str, Any] | None = None) -> None:
        if refusal is not None:
            self._events.append(refusal)
            self._done = True
            return
        body = completion_body(self._model, self._prompt, self._sampling, self._max_tokens, self._stop)
        self._line = await self._post(body, self._timeouts.first_event_s)

    async def _post(self, body: dict[str, Any], first_s: float) -> LineStream:
        try:
            response = await self._session.post(
                self._url + COMPLETIONS_PATH, data=orjson.dumps(body),
                headers=tracing.inject({"content-type": "application/json", wp.REQUEST_ID_HEADER: self._request_id}),
            )
        except TimeoutError:
            raise UpstreamError(UpstreamKind.TIMEOUT, f"connect to {self._url} timed out") from None
        except aiohttp.ClientConnectorError as exc:
            raise UpstreamError(UpstreamKind.CONNECT, f"cannot reach {self._url}: {exc}") from None
        except (aiohttp.ClientError, ConnectionError, OSError) as exc:
            raise UpstreamError(UpstreamKind.DISCONNECT, f"connection to {self._url} broke: {exc}") from None
        if response.status != 200:
            raw = await response.read()
            response.release()
            raise _status_error(self._url, response.status, raw)
        return LineStream(response, first_s, self._timeouts.between_events_s)

    async def next_event(self) -> dict[str, Any] | None:
        while not self._events:
            if self._done:
                return None
            await self._read_chunk()
        return self._events.popleft()

    async def _next_chunk(self) -> dict[str, Any] | None:
        """The call's next SSE data object; None at `[DONE]` or after an error chunk (then a
        `finish` with the error is queued)."""
        assert self._line is not None
        while True:
            line = await self._line.read_line()
            if not line:
                raise UpstreamError(UpstreamKind.PROTOCOL, f"{self._url} ended the stream before [DONE]")
            if line.startswith(b"data:"):
                break  # others: blank separators, comments, event names
        data = line[5:].strip()
        if data == _DONE:
            return None
        try:
            chunk = orjson.loads(data)
        except orjson.JSONDecodeError:
            raise UpstreamError(UpstreamKind.PROTOCOL, f"{self._url} sent a malformed chunk: {data[:80]!r}") from None
        if not isinstance(chunk, dict):
            raise UpstreamError(UpstreamKind.PROTOCOL, f"{self._url} sent a chunk that is not an object")
        if "error" in chunk or chunk.get("object") == "error":
            error = chunk.get("error", chunk)
            message = error.get("message", "server error") if isinstance(error, dict) else str(error)
            self._events.append(_refusal(wp.ErrorKind.ENGINE, message))
            self._done = True
            return None
        return chunk

    async def _read_chunk(self) -> None:
        """Queue the events of the call's next chunk: `ready` before the first, then tokens;
        at the finish reason, read on to the usage chunk for the server's cached count."""
        chunk = await self._next_chunk()
        if chunk is None:
            self._release_line()
            if not self._done:  # [DONE] without a finish reason
                raise UpstreamError(UpstreamKind.PROTOCOL, f"{self._url} ended without a finish reason")
            return
        if not self._ready:
            self._events.append(wp.ready_event(self._prompt_tokens, self._provisional, 0))
            self._ready = True
        reason = None
        for choice in chunk.get("choices") or ():
            self._emit(self._tokens.push(choice.get("text") or ""))
            finish = choice.get("finish_reason")
            if finish is not None:
                reason = (wp.FinishReason.STOP if finish == "stop"
                          else wp.FinishReason.ABORT if finish == "abort" else wp.FinishReason.LENGTH)
        if reason is None:
            return
        usage = chunk.get("usage")
        while (tail := await self._next_chunk()) is not None:  # the usage chunk; the connection stays reusable
            usage = tail.get("usage") or usage
        self._release_line()
        if self._done:  # an error chunk after the finish reason
            return
        cached = ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
        self._emit(self._tokens.flush())
        self._events.append(wp.finish_event(
            reason, num_output_tokens=self._sent,
            cached_tokens=None if cached is None else (min(int(cached), self._prompt_tokens), 0)))
        self._done = True

    def _emit(self, ids: list[int]) -> None:
        if ids:
            self._events.append(wp.tokens_event(ids))
            self._sent += len(ids)

    def _release_line(self) -> None:
        if self._line is not None:
            self._line.release()
            self._line = None

    def close(self) -> None:
        """Drop the connection: the server aborts the request."""
        if self._line is not None:
            self._line.close()
            self._line = None
        self._done = True


class OpenAIUpstream:
    """One OpenAI-compatible worker: its last probed facts, and requests on it."""

    def __init__(self, spec: WorkerSpec, bundle: TokenizerBundle):
        self.spec = spec
        self.facts: OpenAIFacts | None = None
        self._bundle = bundle
        self._text = token_bytes(bundle.json_text)

    async def probe(self, session: aiohttp.ClientSession, timeout_s: float) -> OpenAIFacts:
        self.facts = await probe(session, self.spec, timeout_s)
        return self.facts

    async def generate(self, session: aiohttp.ClientSession, body: dict[str, Any], request_id: str,
                       timeouts: Timeouts) -> OpenAIStream:
        facts = self.facts
        if facts is None:
            raise UpstreamError(UpstreamKind.CONNECT, f"{self.spec.url} not probed yet")
        sampling = body.get("sampling") or {}
        token_ids = body["token_ids"]
        max_tokens = sampling.get("max_tokens", 16)
        refusal = None
        if facts.max_model_len:
            room = facts.max_model_len - len(token_ids)
            if room <= 0:
                refusal = _refusal(wp.ErrorKind.PROMPT_TOO_LONG,
                                   f"The prompt has {len(token_ids)} tokens; this worker's context is "
                                   f"{facts.max_model_len}.")
            max_tokens = min(max_tokens, room)
        if body.get("role", "unified") != "unified" or body.get("kv_handoff"):
            refusal = _refusal(wp.ErrorKind.INVALID_REQUEST, "an openai worker serves whole requests only")
        elif body.get("images"):
            refusal = _refusal(wp.ErrorKind.INVALID_REQUEST, "images are not sent to openai workers", retryable=True)
        elif sampling.get("logprobs"):  # the server's are per its text pieces, not per the gateway's ids
            refusal = _refusal(wp.ErrorKind.INVALID_REQUEST, "openai workers give no token-id logprobs",
                               retryable=True)
        stop = [self._text.text_of(t) for t in sampling.get("stop_token_ids") or ()]
        stream = OpenAIStream(session, self.spec.url, request_id, facts.model, self._text.decode(token_ids),
                              len(token_ids), sampling, max_tokens, stop, TextTokens(self._bundle), timeouts,
                              provisional_cached=provisional_cached(body, len(token_ids), 0))
        await stream.open(refusal)
        return stream
