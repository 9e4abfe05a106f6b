"""What the vLLM and OpenAI-server adapters share: OpenAI's `/v1/completions` API as a worker.

The call (`post_completion`, with the server's refusals as UpstreamErrors), its streamed SSE
chunks (`ChunkReader`), the probe of `/v1/models` and vLLM-style `/metrics`
(`probe_server`), and the worker-protocol events an adapter answers with when it refuses a
request itself (`refusal`, `fit_to_context`), and one request as worker-protocol events
(`CompletionStream`). The adapters (vllm.py, openai.py) differ only in
what they send and how they read a chunk's output.
"""

from __future__ import annotations

import re
from collections import deque
from dataclasses import dataclass
from typing import Any

import orjson

from deepinfer_gateway.config import OpenAIWorkerSpec, VllmWorkerSpec
from deepinfer_gateway.core import protocol as wp
from deepinfer_gateway.core.errors import UpstreamError, UpstreamKind
from deepinfer_gateway.gateway.upstream.http import HttpPool, LineStream, Response

COMPLETIONS_PATH = "/v1/completions"
MODELS_PATH = "/v1/models"
METRICS_PATH = "/metrics"
_DONE = b"[DONE]"
_METRIC_LINE = re.compile(r'^(vllm:[a-z_]+|process_start_time_seconds)(\{[^}]*\})? ([-+0-9.eE]+|NaN)$', re.M)
_BLOCK_SIZE = re.compile(r'[{,]block_size="(\d+)"')


def refusal(kind: wp.ErrorKind, message: str, *, retryable: bool | None = None) -> dict[str, Any]:
    """The `finish` event of a request the adapter refuses without calling the server."""
    event = wp.finish_event(wp.FinishReason.ERROR, error_kind=kind, message=message)
    if retryable is not None:
        event["error"]["retryable"] = retryable
    return event


def fit_to_context(prompt_tokens: int, max_tokens: int, max_model_len: int) -> tuple[int, dict[str, Any] | None]:
    """`max_tokens` cut to the server's context (servers refuse more), or a refusal when the
    prompt alone fills it; `max_model_len` 0: not reported, nothing cut."""
    if not max_model_len:
        return max_tokens, None
    room = max_model_len - prompt_tokens
    if room <= 0:
        return max_tokens, refusal(wp.ErrorKind.PROMPT_TOO_LONG, f"The prompt has {prompt_tokens} tokens; this "
                                                                 f"worker's context is {max_model_len}.")
    return min(max_tokens, room), None


def provisional_cached(predicted: int, prompt_tokens: int, block_size: int) -> int:
    """`ready`'s cached count before the server reports its own: the router's predicted overlap
    (with KV events, vLLM's cached full blocks), cut as vLLM cuts a hit (whole blocks, at least
    the last prompt token computed; `block_size` 0: not known)."""
    limit = prompt_tokens - 1
    if block_size > 0:
        limit = limit // block_size * block_size
    return max(0, min(predicted, limit))


def finish_reason(finish: str) -> wp.FinishReason:
    return (wp.FinishReason.STOP if finish == "stop"
            else wp.FinishReason.ABORT if finish == "abort" else wp.FinishReason.LENGTH)


def status_error(url: str, status: int, raw: bytes) -> UpstreamError:
    """A server's refusal: 400/422 is the request's fault (prompt too long, bad ids), never
    retried and not a health failure; 429 and 5xx go elsewhere."""
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


async def post_completion(http: HttpPool, url: str, request_id: str, body: dict[str, Any]) -> Response:
    """POST `body` to the server's `/v1/completions`; a 200 response, else an UpstreamError."""
    response = await http.post(url, COMPLETIONS_PATH, body, request_id)
    if response.status != 200:
        raw = await response.read()
        response.release()
        raise status_error(url, response.status, raw)
    return response


class ChunkReader:
    """A streamed completion's SSE data objects, one per `next()`; None at `[DONE]` or after an
    error chunk, which leaves its worker-protocol `finish` in `error`."""

    def __init__(self, line: LineStream, url: str):
        self._line: LineStream | None = line
        self._url = url
        self.error: dict[str, Any] | None = None

    async def next(self) -> dict[str, Any] | None:
        assert self._line is not None, "read after release"
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
            self.error = refusal(wp.ErrorKind.ENGINE, message)
            return None
        return chunk

    def release(self) -> None:
        """The stream was read to its end: the connection goes back to the pool."""
        if self._line is not None:
            self._line.release()
            self._line = None

    def close(self) -> None:
        """Drop the connection (the server aborts the request); nothing once released."""
        if self._line is not None:
            self._line.close()
            self._line = None


class CompletionStream:
    """One worker-protocol request as ONE streamed completion call. `ready` goes out with the
    first chunk (servers stream nothing before their first token), with the prompt count and
    a provisional cached count; at the finish reason the stream is read on to the usage chunk
    and `[DONE]`, and `finish` carries the server's real cached count. Subclasses say what a
    choice's output is (`_choice`) and may add tokens at the end (`_tail`)."""

    def __init__(self, url: str, prompt_tokens: int, provisional_cached: int):
        self._url = url
        self._prompt_tokens = prompt_tokens
        self._provisional = provisional_cached  # `ready`'s cached count; the real one comes with `finish`
        self._chunks: ChunkReader | None = None
        self._events: deque[dict[str, Any]] = deque()
        self._ready = False
        self._done = False
        self._sent = 0  # output token ids emitted

    def refuse(self, refused: dict[str, Any]) -> None:
        """End at once with the adapter's own refusal (a `finish` event): no call is made."""
        self._events.append(refused)
        self._done = True

    async def start(self, http: HttpPool, request_id: str, body: dict[str, Any]) -> None:
        """Send the call; its chunks are read as `next_event` asks."""
        response = await post_completion(http, self._url, request_id, body)
        timeouts = http.timeouts
        self._chunks = ChunkReader(LineStream(response, timeouts.first_event_s, timeouts.between_events_s), self._url)

    async def next_event(self) -> dict[str, Any] | None:
        while not self._events:
            if self._done:
                return None
            await self._read_chunk()
        return self._events.popleft()

    def buffered(self) -> bool:
        """Only events already made from read chunks count: the server's next SSE line may be a
        separator or a comment that `next_event` would read past and then wait."""
        return bool(self._events)

    def _choice(self, choice: dict[str, Any]) -> None:
        """Queue one streamed choice's output tokens (`_emit`)."""
        raise NotImplementedError

    def _tail(self) -> None:
        """Queue any output held back until the finish reason."""

    def _final_cached(self, usage: dict[str, Any]) -> int | None:
        """The server's cached prompt tokens from its final usage; None: not reported."""
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        return None if cached is None else min(int(cached), self._prompt_tokens)

    def _emit(self, ids: list[int], logprobs: list[Any] | None = None) -> None:
        if ids:
            self._events.append(wp.tokens_event(ids, logprobs))
            self._sent += len(ids)

    async def _read_chunk(self) -> None:
        """Queue the events of the call's next chunk (see the class doc)."""
        assert self._chunks is not None
        chunk = await self._chunks.next()
        if chunk is None:
            if not self._end_of_stream():
                raise UpstreamError(UpstreamKind.PROTOCOL, f"{self._url} ended without a finish reason")
            return
        if not self._ready:
            self._events.append(wp.ready_event(self._prompt_tokens, self._provisional, 0))
            self._ready = True
        reason = None
        for choice in chunk.get("choices") or ():
            self._choice(choice)
            if choice.get("finish_reason") is not None:
                reason = finish_reason(choice["finish_reason"])
        if reason is None:
            return
        usage = chunk.get("usage")
        while (tail := await self._chunks.next()) is not None:  # the usage chunk; the connection stays reusable
            usage = tail.get("usage") or usage
        if self._end_of_stream():  # an error chunk after the finish reason
            return
        self._tail()
        cached = self._final_cached(usage or {})
        self._events.append(wp.finish_event(reason, num_output_tokens=self._sent,
                                            cached_tokens=None if cached is None else (cached, 0)))
        self._done = True

    def _end_of_stream(self) -> bool:
        """The stream was read to its end (`[DONE]` or an error chunk): the connection is
        released, an error chunk's `finish` queued. True when an error chunk ended it."""
        assert self._chunks is not None
        self._chunks.release()
        if self._chunks.error is None:
            return False
        self._events.append(self._chunks.error)
        self._done = True
        return True

    def close(self) -> None:
        """Drop the connection: the server aborts the request."""
        if self._chunks is not None:
            self._chunks.close()
        self._done = True


def parse_metrics(text: str) -> tuple[dict[str, float], int]:
    """vLLM's gauges summed over engines (DP ranks), and its KV block size (0: not reported)."""
    values: dict[str, float] = {}
    for name, _labels, value in _METRIC_LINE.findall(text):
        values[name] = values.get(name, 0.0) + float(value)
    info = text.find("vllm:cache_config_info{")
    block = _BLOCK_SIZE.search(text[info:]) if info >= 0 else None
    return values, int(block.group(1)) if block else 0


@dataclass(frozen=True)
class ServerFacts:
    """What one probe of the server found: its model, context and vLLM-style gauges."""

    model: str
    max_model_len: int  # 0: not reported
    gauges: dict[str, float]
    block_size: int  # 0: not reported

    @property
    def running(self) -> int:
        return int(self.gauges.get("vllm:num_requests_running", 0))

    @property
    def waiting(self) -> int:
        return int(self.gauges.get("vllm:num_requests_waiting", 0))

    @property
    def kv_usage(self) -> float:
        return self.gauges.get("vllm:kv_cache_usage_perc", 0.0)


async def probe_server(http: HttpPool, spec: VllmWorkerSpec | OpenAIWorkerSpec, *,
                       metrics_required: bool) -> ServerFacts:
    """Read `/v1/models` (the spec's model, else the first) and `/metrics` (an error only when
    `metrics_required`); any failure is an UpstreamError."""
    status, raw = await http.get(spec.url, MODELS_PATH)
    if status != 200:
        raise UpstreamError(UpstreamKind.HTTP_STATUS, f"{spec.url}{MODELS_PATH} answered {status}", status=status)
    try:
        models = orjson.loads(raw)["data"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        raise UpstreamError(UpstreamKind.PROTOCOL, f"{spec.url}{MODELS_PATH} returned no model list") from None
    status, raw = await http.get(spec.url, METRICS_PATH)
    if status != 200 and metrics_required:
        raise UpstreamError(UpstreamKind.HTTP_STATUS, f"{spec.url}{METRICS_PATH} answered {status}", status=status)
    metrics = raw.decode(errors="replace") if status == 200 else ""
    model = next((m for m in models if isinstance(m, dict) and (not spec.model or m.get("id") == spec.model)), None)
    if model is None or not isinstance(model.get("id"), str):
        raise UpstreamError(UpstreamKind.PROTOCOL, f"{spec.url} does not serve model {spec.model or '(any)'}")
    gauges, block_size = parse_metrics(metrics)
    return ServerFacts(model["id"], int(model.get("max_model_len") or 0), gauges, block_size)
