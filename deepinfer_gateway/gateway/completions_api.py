"""What the vLLM and OpenAI-server adapters share: OpenAI's `/v1/completions` API as a worker.

The call (`post_completion`, with the server's refusals as UpstreamErrors), its streamed SSE
chunks (`ChunkReader`), the probe of `/v1/models` and vLLM-style `/metrics`
(`probe_server`), and the worker-protocol events an adapter answers with when it refuses a
request itself (`refusal`, `fit_to_context`). The adapters (vllm_upstream.py,
openai_upstream.py) differ only in what they send and how they read a chunk's output.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from deepinfer_gateway import protocol as wp
from deepinfer_gateway import tracing
from deepinfer_gateway.config import WorkerSpec
from deepinfer_gateway.errors import UpstreamError, UpstreamKind
from deepinfer_gateway.gateway.worker_client import LineStream

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


async def post_completion(session: aiohttp.ClientSession, url: str, request_id: str,
                          body: dict[str, Any]) -> aiohttp.ClientResponse:
    """POST `body` to the server's `/v1/completions`; a 200 response, else an UpstreamError."""
    try:
        response = await session.post(
            url + COMPLETIONS_PATH, data=orjson.dumps(body),
            headers=tracing.inject({"content-type": "application/json", wp.REQUEST_ID_HEADER: request_id}),
        )
    except TimeoutError:
        raise UpstreamError(UpstreamKind.TIMEOUT, f"connect to {url} timed out") from None
    except aiohttp.ClientConnectorError as exc:
        raise UpstreamError(UpstreamKind.CONNECT, f"cannot reach {url}: {exc}") from None
    except (aiohttp.ClientError, ConnectionError, OSError) as exc:
        raise UpstreamError(UpstreamKind.DISCONNECT, f"connection to {url} broke: {exc}") from None
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


async def probe_server(session: aiohttp.ClientSession, spec: WorkerSpec, timeout_s: float, *,
                       metrics_required: bool) -> ServerFacts:
    """Read `/v1/models` (the spec's model, else the first) and `/metrics` (an error only when
    `metrics_required`); any failure is an UpstreamError."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    try:
        async with session.get(spec.url + MODELS_PATH, timeout=timeout) as r:
            if r.status != 200:
                raise UpstreamError(UpstreamKind.HTTP_STATUS, f"{spec.url}{MODELS_PATH} answered {r.status}",
                                    status=r.status)
            models = orjson.loads(await r.read())["data"]
        async with session.get(spec.url + METRICS_PATH, timeout=timeout) as r:
            if r.status != 200 and metrics_required:
                raise UpstreamError(UpstreamKind.HTTP_STATUS, f"{spec.url}{METRICS_PATH} answered {r.status}",
                                    status=r.status)
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
    gauges, block_size = parse_metrics(metrics)
    return ServerFacts(model["id"], int(model.get("max_model_len") or 0), gauges, block_size)
