"""Streaming requests through the real SDKs, one `RequestRecord` per call.

One `ProtocolClient` per run, holding one SDK client with a connection pool sized for
the run's concurrency (the SDKs' default pools would queue requests client-side and be
measured as server latency). Headers (worker id) come from `with_raw_response`.

- chat:      openai `chat.completions`, stream + `stream_options.include_usage`;
             cached tokens from `usage.prompt_tokens_details.cached_tokens`
             (DeepSeek's `usage.prompt_cache_hit_tokens` as a fallback).
- responses: openai `responses`, stream; `usage.input_tokens_details.cached_tokens`.
- messages:  anthropic `messages`, stream; `usage.cache_read_input_tokens`.

Timing: TTFT = first chunk carrying output (text, reasoning or tool-call delta); each
later output chunk adds one inter-chunk gap to `itl_s`; e2e = end of the stream.

`send` sends one user message; `converse` a whole conversation (closed-loop sessions), with
the session's id in `X-Session-ID` and `X-Correlation-ID` (the headers AIPerf and Dynamo's
clients pin sessions with; a subagent's parent in `x-parent-session-id`), and returns the
answer as the assistant's turn, with the agent's tool offered where asked (turns.py).
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from deepinfer_gateway.core.headers import SESSIONS as SESSION_HEADERS
from deepinfer_gateway.core.headers import WORKER as WORKER_HEADER
from deepinfer_gateway.loadgen.turns import (
    ToolCallParts,
    Turn,
    chat_message,
    chat_tools,
    messages_of,
    messages_tools,
    responses_input,
    responses_tools,
)
from deepinfer_gateway.workload.types import RecordError, RequestRecord

PROTOCOLS = ("chat", "responses", "messages")
PARENT_SESSION_HEADER = "x-parent-session-id"  # a subagent's parent session (docs/api.md "Sessions")
CALL_CLOSE_TOKENS = 32  # a forced call's room beyond the length asked: its closing tags


@dataclass(frozen=True)
class ClientConfig:
    url: str  # server root or .../v1
    model: str
    protocol: str = "chat"
    api_key: str = "bench"
    max_connections: int = 1024
    request_timeout_s: float = 600.0
    ignore_eos: bool = False
    # chat only: the SSE stream is read here (aiohttp + orjson) instead of by the SDK, whose
    # per-chunk model construction costs several times more client CPU: where the load generator
    # shares a few cores with the server under test, its own stalls would count as TTFT.
    lean: bool = False

    @property
    def root(self) -> str:
        return self.url.rstrip("/").removesuffix("/v1")


def _http_client(config: ClientConfig, cls: type) -> Any:
    """The SDK's own default async HTTP client class with a pool sized for the run.

    The SDKs ship their own httpx flavour (httpx or its fork httpx2); `Limits` must come
    from the same package as the client class.
    """
    base = next(c for c in cls.__mro__ if c.__name__ == "AsyncClient")
    transport = importlib.import_module(base.__module__.split(".")[0])
    limits = transport.Limits(max_connections=config.max_connections,
                              max_keepalive_connections=config.max_connections)
    return cls(limits=limits, timeout=transport.Timeout(config.request_timeout_s, connect=30.0))


def classify(exc: BaseException) -> tuple[str, int | None]:
    """SDK/transport exception -> (RecordError, HTTP status or None), by type names so that it
    holds for openai, anthropic and either httpx flavour."""
    status = getattr(exc, "status_code", None)
    names = " ".join(c.__name__ for c in type(exc).__mro__)
    if isinstance(exc, asyncio.CancelledError):
        return RecordError.CANCELLED, None
    if _never_connected(exc):
        return RecordError.CONNECT, None
    if "Timeout" in names:
        return RecordError.TIMEOUT, None
    if isinstance(status, int):
        if status == 429:
            return RecordError.RATE_LIMITED, status
        return (RecordError.HTTP_5XX if status >= 500 else RecordError.HTTP_4XX), status
    if "Connect" in names:
        return RecordError.CONNECTION, None
    if any(n in names for n in ("RemoteProtocolError", "ReadError", "StreamError", "DecodingError", "ValueError")):
        return RecordError.STREAM, None
    return RecordError.CLIENT, None


_CONNECT_ERRORS = frozenset({"ConnectError", "ConnectTimeout"})  # httpx's and httpcore's


def _never_connected(exc: BaseException) -> bool:
    """Whether the error, or one it was raised from (the SDKs wrap httpx's), is a connection that
    could not be opened: the server never got the request, so another may be sent it."""
    seen: BaseException | None = exc
    for _ in range(8):
        if seen is None:
            return False
        if type(seen).__name__ in _CONNECT_ERRORS:
            return True
        seen = seen.__cause__ or seen.__context__
    return False


async def _parsed(raw: Any) -> Any:
    parsed = raw.parse()
    return await parsed if inspect.isawaitable(parsed) else parsed


class _Timer:
    """Marks output chunks: first one sets TTFT, later ones append gaps."""

    def __init__(self, record: RequestRecord, start: float):
        self.record = record
        self.start = start
        self.last: float | None = None

    def output(self) -> None:
        now = time.perf_counter()
        if self.last is None:
            self.record.ttft_s = now - self.start
        else:
            self.record.itl_s.append(now - self.last)
        self.last = now


class ProtocolClient:
    def __init__(self, config: ClientConfig):
        if config.protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {PROTOCOLS}")
        self.config = config
        if config.protocol == "messages":
            import anthropic

            self._sdk: Any = anthropic.AsyncAnthropic(
                base_url=config.root, api_key=config.api_key, max_retries=0,
                http_client=_http_client(config, anthropic.DefaultAsyncHttpxClient))
        else:
            import openai

            self._sdk = openai.AsyncOpenAI(
                base_url=config.root + "/v1", api_key=config.api_key, max_retries=0,
                http_client=_http_client(config, openai.DefaultAsyncHttpxClient))

        self._lean: Any = None
        if config.lean:
            if config.protocol != "chat":
                raise ValueError("the lean client speaks the chat protocol only")
            import aiohttp

            self._lean = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=config.max_connections),
                timeout=aiohttp.ClientTimeout(total=config.request_timeout_s, sock_connect=30.0))

    async def aclose(self) -> None:
        await self._sdk.close()
        if self._lean is not None:
            await self._lean.close()

    async def send(self, prompt: str, max_tokens: int, record: RequestRecord) -> None:
        """Run one streamed request, filling `record`; never raises except CancelledError."""
        await self.converse((Turn("user", prompt),), max_tokens, record)

    async def converse(self, turns: Sequence[Turn], max_tokens: int, record: RequestRecord,
                       session_id: str | None = None, parent_session_id: str | None = None,
                       tool_choice: str | None = None) -> Turn:
        """Run one streamed request of a conversation, filling `record`; returns the answer as
        the assistant's turn (its text "" on failure). Never raises except CancelledError.
        `parent_session_id`: a subagent's parent, in `x-parent-session-id` (OpenCode's header).
        `tool_choice`: offer the agent's tool with this choice (turns.py)."""
        if tool_choice == "required" and self.config.ignore_eos:
            max_tokens += CALL_CLOSE_TOKENS
        start = time.perf_counter()
        timer = _Timer(record, start)
        headers = {name: session_id for name in SESSION_HEADERS} if session_id else None
        if headers is not None and parent_session_id:
            headers[PARENT_SESSION_HEADER] = parent_session_id
        answer: list[str] = []
        calls = ToolCallParts()
        try:
            stream = getattr(self, f"_{self.config.protocol}")(turns, max_tokens, record, headers, tool_choice, calls)
            async for text in stream:
                timer.output()
                if text is None:  # a reasoning chunk: not part of the answer's text
                    record.reasoning = True
                else:
                    answer.append(text)
            record.e2e_s = time.perf_counter() - start
            record.status = "ok"
            return Turn("assistant", "".join(answer), calls.calls())
        except asyncio.CancelledError:
            record.status, record.error = "error", RecordError.CANCELLED
            raise
        except Exception as exc:  # every failure becomes a record
            record.status = "error"
            record.error, status = classify(exc)
            record.http_status = status or record.http_status
            record.detail = f"{type(exc).__name__}: {exc}"[:300]
            record.ttft_s = record.e2e_s = None
        return Turn("assistant", "")

    def _extra(self, tool_choice: str | None, max_tokens: int) -> dict[str, Any]:
        """`ignore_eos` where configured. On a forced call `min_tokens` instead (the length asked;
        `converse` made room for the call's closing tags): past the call's end, ignore_eos would
        append text to it."""
        if not self.config.ignore_eos:
            return {}
        return {"min_tokens": max_tokens - CALL_CLOSE_TOKENS} if tool_choice == "required" else {"ignore_eos": True}

    # Each protocol method yields once per output chunk (the answer's text, None for reasoning) and fills usage fields.
    async def _chat(self, turns: Sequence[Turn], max_tokens: int, record: RequestRecord,
                    headers: dict[str, str] | None, tool_choice: str | None,
                    calls: ToolCallParts) -> AsyncIterator[str | None]:
        if self._lean is not None:
            async for text in self._chat_lean(turns, max_tokens, record, headers, tool_choice, calls):
                yield text
            return
        raw = await self._sdk.chat.completions.with_raw_response.create(
            model=self.config.model, messages=[chat_message(t) for t in turns],
            max_tokens=max_tokens, stream=True, stream_options={"include_usage": True},
            extra_body={**self._extra(tool_choice, max_tokens), **chat_tools(tool_choice)} or None,
            extra_headers=headers)
        record.http_status = raw.status_code
        record.worker = raw.headers.get(WORKER_HEADER)
        async with await _parsed(raw) as stream:
            async for chunk in stream:
                if chunk.usage is not None:
                    _chat_usage(chunk.usage, record)
                if chunk.choices:
                    delta = chunk.choices[0].delta
                    if delta.tool_calls:
                        calls.add(call.model_dump() for call in delta.tool_calls)
                    if delta.content or delta.tool_calls:
                        yield delta.content or ""
                    elif getattr(delta, "reasoning_content", None):
                        yield None

    async def _chat_lean(self, turns: Sequence[Turn], max_tokens: int, record: RequestRecord,
                         headers: dict[str, str] | None, tool_choice: str | None,
                         calls: ToolCallParts) -> AsyncIterator[str | None]:
        """`_chat` without the SDK: the same request body over aiohttp (C HTTP parser), SSE
        `data:` lines parsed with orjson."""
        import orjson

        body = {"model": self.config.model, "messages": [chat_message(t) for t in turns],
                "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True},
                **self._extra(tool_choice, max_tokens), **chat_tools(tool_choice)}
        async with self._lean.post(
                self.config.root + "/v1/chat/completions", data=orjson.dumps(body),
                headers={"content-type": "application/json", "authorization": f"Bearer {self.config.api_key}",
                         **(headers or {})}) as response:
            record.http_status = response.status
            record.worker = response.headers.get(WORKER_HEADER)
            if response.status != 200:
                raise HttpStatusError(response.status, (await response.read())[:300].decode(errors="replace"))
            async for line in response.content:
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = orjson.loads(data)
                if "error" in chunk:
                    raise ValueError(f"stream reported an error: {str(chunk['error'])[:200]}")
                if chunk.get("usage"):
                    _chat_usage_dict(chunk["usage"], record)
                choices = chunk.get("choices")
                if choices:
                    delta = choices[0].get("delta") or {}
                    if delta.get("tool_calls"):
                        calls.add(delta["tool_calls"])
                    if delta.get("content") or delta.get("tool_calls"):
                        yield delta.get("content") or ""
                    elif delta.get("reasoning_content"):
                        yield None

    async def _responses(self, turns: Sequence[Turn], max_tokens: int, record: RequestRecord,
                         headers: dict[str, str] | None, tool_choice: str | None,
                         calls: ToolCallParts) -> AsyncIterator[str | None]:
        system = "".join(t.text for t in turns if t.role == "system")
        rest = [t for t in turns if t.role != "system"]
        text_input: Any = rest[0].text if len(rest) == 1 and rest[0].role == "user" else responses_input(rest)
        raw = await self._sdk.responses.with_raw_response.create(
            model=self.config.model, input=text_input, max_output_tokens=max_tokens, stream=True,
            extra_body={**self._extra(tool_choice, max_tokens), **responses_tools(tool_choice)} or None,
            extra_headers=headers,
            **({"instructions": system} if system else {}))
        record.http_status = raw.status_code
        record.worker = raw.headers.get(WORKER_HEADER)
        async with await _parsed(raw) as stream:
            async for event in stream:
                kind = event.type
                if kind == "response.output_text.delta":
                    yield event.delta
                elif kind.startswith("response.reasoning") and kind.endswith(".delta"):
                    yield None
                elif kind == "response.output_item.added" and event.item.type == "function_call":
                    calls.add([{"index": event.output_index, "id": event.item.call_id,
                                "function": {"name": event.item.name, "arguments": event.item.arguments}}])
                elif kind == "response.function_call_arguments.delta":
                    calls.add([{"index": event.output_index, "function": {"arguments": event.delta}}])
                    yield ""
                elif kind.endswith(".delta") and kind != "response.audio.delta":
                    yield ""
                elif kind in ("response.completed", "response.incomplete") and event.response.usage:
                    usage = event.response.usage
                    record.prompt_tokens = usage.input_tokens
                    record.output_tokens = usage.output_tokens
                    details = usage.input_tokens_details
                    record.cached_tokens = getattr(details, "cached_tokens", None) if details else None
                elif kind in ("response.failed", "error"):
                    raise ValueError(f"stream reported {kind}")

    async def _messages(self, turns: Sequence[Turn], max_tokens: int, record: RequestRecord,
                        headers: dict[str, str] | None, tool_choice: str | None,
                        calls: ToolCallParts) -> AsyncIterator[str | None]:
        system = "".join(t.text for t in turns if t.role == "system")
        raw = await self._sdk.messages.with_raw_response.create(
            model=self.config.model, messages=messages_of(turns), max_tokens=max_tokens, stream=True,
            extra_body={**self._extra(tool_choice, max_tokens), **messages_tools(tool_choice)} or None,
            extra_headers=headers,
            **({"system": system} if system else {}))
        record.http_status = raw.status_code
        record.worker = raw.headers.get(WORKER_HEADER)
        stream = await _parsed(raw)
        async with stream:
            async for event in stream:
                kind = event.type
                if kind == "content_block_start" and event.content_block.type == "tool_use":
                    block = event.content_block
                    calls.add([{"index": event.index, "id": block.id, "function": {"name": block.name}}])
                elif kind == "content_block_delta":
                    if event.delta.type == "input_json_delta":
                        calls.add([{"index": event.index, "function": {"arguments": event.delta.partial_json}}])
                    thinking = event.delta.type in ("thinking_delta", "signature_delta")
                    yield None if thinking else getattr(event.delta, "text", None) or ""
                elif kind == "message_start":
                    usage = event.message.usage
                    cached = getattr(usage, "cache_read_input_tokens", None)
                    created = getattr(usage, "cache_creation_input_tokens", None) or 0
                    # Anthropic's input_tokens excludes cache reads and writes.
                    record.prompt_tokens = usage.input_tokens + (cached or 0) + created
                    record.cached_tokens = cached
                elif kind == "message_delta" and event.usage is not None:
                    record.output_tokens = event.usage.output_tokens
                elif kind == "error":
                    raise ValueError("stream reported an error event")


class HttpStatusError(Exception):
    """A non-200 answer to the lean client (classify reads `status_code`, as on SDK errors)."""

    def __init__(self, status_code: int, text: str):
        super().__init__(f"HTTP {status_code}: {text}")
        self.status_code = status_code


def _chat_usage_dict(usage: dict[str, Any], record: RequestRecord) -> None:
    record.prompt_tokens = usage.get("prompt_tokens")
    record.output_tokens = usage.get("completion_tokens")
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    record.cached_tokens = usage.get("prompt_cache_hit_tokens") if cached is None else cached


def _chat_usage(usage: Any, record: RequestRecord) -> None:
    record.prompt_tokens = usage.prompt_tokens
    record.output_tokens = usage.completion_tokens
    details = usage.prompt_tokens_details
    cached = getattr(details, "cached_tokens", None) if details is not None else None
    if cached is None:
        cached = (getattr(usage, "model_extra", None) or {}).get("prompt_cache_hit_tokens")
    record.cached_tokens = cached
