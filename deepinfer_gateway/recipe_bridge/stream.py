"""Engine tokens -> protocol chunks (SSE frames) or one accumulated response body.

Wraps deepseek-recipe's StreamProcessor, which decodes token ids and parses reasoning,
answer text and DSML tool calls for each protocol. This module only frames what the
library emits (SSE event names and the final `[DONE]` come from the library too).

One worker `tokens` event (one engine step: several ids with speculative decoding) is
pushed whole and comes out as one protocol chunk carrying all its text, and its logprobs
as a list (every protocol that has logprobs takes several tokens' worth per chunk: Chat's
`logprobs.content`, Responses' `response.output_text.delta` `logprobs` when `include` asks
(recipe_bridge/includes.py), legacy Completions' parallel arrays; Messages has none).
Several chunks come out of one event only where the protocol's own structure changes inside
it (reasoning ends, a tool call opens).

Stop sequences are the exception: the client's usage must count the tokens up to the one
that completed the match, not the step's later ones. `StopGuard` sees the step's raw bytes
first; when a stop sequence may complete inside them, the step is pushed token by token.

Cost: ~2.5 us per relayed token at 4 tokens per worker message, i.e. ~350-400k tokens/s
on one core (bench/preprocess.py, `relay_tokens_per_s_per_core`).
"""

from __future__ import annotations

import re
from typing import Any

import deepseek_recipe as dr
import orjson

from deepinfer_gateway.recipe_bridge.completion_stream import (
    TextCompletionProcessor,
    TextCompletionResponse,
)
from deepinfer_gateway.recipe_bridge.completions import LegacyOptions
from deepinfer_gateway.recipe_bridge.detokenizer import TokenBytes, token_bytes
from deepinfer_gateway.recipe_bridge.final_usage import corrected_json, set_cached
from deepinfer_gateway.recipe_bridge.includes import STREAM_TEXT_EVENTS, stream_logprobs
from deepinfer_gateway.recipe_bridge.prepare import ApiProtocol, PreparedRequest
from deepinfer_gateway.recipe_bridge.tokenizer import TokenizerBundle

_FINISH = {
    "stop": dr.InferenceFinishReason.Stop,
    "length": dr.InferenceFinishReason.Length,
    "content_filter": dr.InferenceFinishReason.ContentFilter,
}

_RESPONSE_TYPES: dict[ApiProtocol, Any] = {
    ApiProtocol.CHAT: dr.ChatCompletionResponse,
    ApiProtocol.RESPONSES: dr.ResponsesResponse,
    ApiProtocol.MESSAGES: dr.MessagesResponse,
    ApiProtocol.COMPLETIONS: TextCompletionResponse,
}

ID_PREFIX = {ApiProtocol.CHAT: "chatcmpl-", ApiProtocol.RESPONSES: "resp_", ApiProtocol.MESSAGES: "msg_",
             ApiProtocol.COMPLETIONS: "cmpl-"}


def _generator(prepared: PreparedRequest, response_id: str) -> Any:
    conv = prepared.conversation
    assert conv is not None
    if prepared.protocol is ApiProtocol.CHAT:
        return dr.ChatCompletionRequest.chunk_generator(conv, response_id, prepared.requested_model)
    if prepared.protocol is ApiProtocol.RESPONSES:
        generator = dr.ResponsesRequest.chunk_generator(conv, response_id, prepared.requested_model)
        if prepared.namespace_tool_map:
            generator = generator.with_namespace_tool_map(prepared.namespace_tool_map)
        if prepared.responses_echo is not None:
            generator = generator.with_echo(prepared.responses_echo)
        return generator
    return dr.MessagesRequest.chunk_generator(conv, response_id, prepared.requested_model)


_TIER_MEMBER = re.compile(r'"service_tier":"[^"]*"')


class StopGuard:
    """Says whether a stop sequence may complete inside a step's tokens, from their raw bytes
    and the end of the output before them. A superset of the real matches (raw bytes include
    reasoning and markup the parsers match nothing in), so a step it passes cannot end the
    answer and can be pushed whole."""

    def __init__(self, table: TokenBytes, stops: list[str]):
        self._bytes_of = table.bytes_of
        self._stops = [s.encode() for s in stops if s]
        self._keep = max(map(len, self._stops), default=1) - 1  # a match may start this far back
        self._tail = b""

    def may_stop(self, token_ids: list[int]) -> bool:
        raw = self._tail + self._bytes_of(token_ids)
        self._tail = raw[len(raw) - self._keep:] if self._keep else b""
        return any(stop in raw for stop in self._stops)


class _Framing:
    """What both response streams share: SSE framing (or the accumulated body), `[DONE]`,
    the counts, and the final usage's correction when `finish` brings the worker's real
    cached count (vLLM). Feed worker events in order; each call returns bytes to send.

    Streaming mode returns SSE frames from every call; non-streaming mode returns b""
    until `body()` is asked for the accumulated JSON response."""

    _split_usage = False  # chat's include_usage: usage in its own final chunk
    _corrects_json = True  # the final usage is corrected in the protocol's JSON (corrected_json)

    def __init__(self, prepared: PreparedRequest, response_id: str):
        self.prepared = prepared
        self.response_id = response_id
        self._response_type = _RESPONSE_TYPES[prepared.protocol]
        self._accumulator: Any = None
        self._stream = prepared.stream
        # Chat and legacy completions frame every chunk as a bare `data:` line (no SSE event names).
        self._named = prepared.protocol in (ApiProtocol.RESPONSES, ApiProtocol.MESSAGES)
        # Responses' text events carry logprobs in the stream's own shape (includes.py).
        self._stream_logprobs = prepared.protocol is ApiProtocol.RESPONSES and prepared.sampling.logprobs
        self.completion_tokens = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0  # `ready`'s, then the worker's final count if `finish` brought one
        self._correct_usage = False  # `finish` brought a different cached count: final frames get it
        self.done = False  # the client has its complete answer (finish, or a stop sequence matched)
        self._stop_guard: StopGuard | None = None  # set by a subclass when the request has stop sequences
        # OpenAI's `service_tier` echo: the first member of each chat chunk and of the whole answer;
        # a Responses object's and a Messages usage's own member (deepseek-recipe writes one) gets its value.
        echo = prepared.service_tier_echo
        self._tier_member = f'{{"service_tier":"{echo}",' if echo else None
        self._tier_value = f'"service_tier":"{echo}"'

    def _tiered(self, data: str) -> str:
        """`data` (a JSON object) with the service tier echoed: Chat's chunks, a Responses event's
        `response` object. An unescaped `"service_tier":"` occurs only as a member name (inside
        strings quotes are escaped), and a Responses event has one object that carries it."""
        if self._tier_member is None:
            return data
        if self._named:  # Responses and Messages: their objects' own member (deepseek-recipe writes one)
            return _TIER_MEMBER.sub(self._tier_value, data, count=1)
        return self._tier_member + data[1:]

    def _start(self, prompt_tokens: int, cached_tokens: int) -> None:
        self.prompt_tokens, self.cached_tokens = prompt_tokens, cached_tokens
        if not self._stream:
            self._accumulator = self._response_type(
                self.response_id, self.prepared.requested_model, self.prepared.created, prompt_tokens, cached_tokens
            )

    def _final_cached(self, cached_tokens: int | None) -> None:
        if cached_tokens is not None and cached_tokens != self.cached_tokens:
            self.cached_tokens = cached_tokens
            self._correct_usage = True

    def _processor_finished(self) -> bool:
        return False

    def tokens(self, token_ids: list[int], logprobs: list[Any] | None = None) -> bytes:
        """One worker `tokens` event (one engine step): its protocol bytes, one chunk for the
        whole step unless a stop sequence may complete inside it (module doc)."""
        if self.done:  # a stop sequence already ended the answer; the engine's later tokens are dropped
            return b""
        guard = self._stop_guard
        if guard is None or not guard.may_stop(token_ids) or len(token_ids) == 1:
            return self._push(token_ids, logprobs)
        parts: list[bytes] = []
        for i, token in enumerate(token_ids):
            parts.append(self._push([token], None if logprobs is None else logprobs[i:i + 1]))
            if self.done:
                break
        return b"".join(parts)

    def _push(self, token_ids: list[int], logprobs: list[Any] | None) -> bytes:
        raise NotImplementedError

    def _done(self) -> bytes:
        self.done = True
        if self._stream:
            done: str | None = self._response_type.sse_done_data()
            if done is not None:
                return b"data: " + done.encode() + b"\n\n"
        return b""

    def body(self) -> bytes:
        text: str = self._accumulator.to_json()
        if self._correct_usage and self._corrects_json:
            text = corrected_json(self.prepared.protocol, text, self.prompt_tokens, self.cached_tokens)
        if self._tier_member is not None and self.prepared.protocol is ApiProtocol.CHAT:
            text = self._tier_member + text[1:]
        elif self._tier_member is not None:  # Responses, Messages
            text = _TIER_MEMBER.sub(self._tier_value, text, count=1)
        return text.encode()

    def _emit(self, chunks: list[Any], final: bool = False) -> bytes:
        if not chunks:
            return b""
        if not self._stream:
            for chunk in chunks:
                self._accumulator.accumulate(chunk)
            return b""
        split = self._split_usage and (final or self._processor_finished())
        if len(chunks) == 1 and not self._named and not split and not (final and self._correct_usage):
            frame: str = self._tiered(chunks[0].to_json())
            return b"data: " + frame.encode() + b"\n\n"  # the usual token chunk
        parts: list[bytes] = []
        name_of = self._response_type.sse_event_name
        for chunk in chunks:
            data = self._tiered(chunk.to_json())
            if split and '"usage":' in data:
                parts.extend(self._chat_usage_frames(data, final))
                continue
            if final and self._correct_usage and self._corrects_json:
                data = corrected_json(self.prepared.protocol, data, self.prompt_tokens, self.cached_tokens)
            name = name_of(chunk)
            if self._stream_logprobs and name in STREAM_TEXT_EVENTS:
                data = stream_logprobs(data)
            if name:
                parts.append(b"event: " + name.encode() + b"\n")
            parts.append(b"data: " + data.encode() + b"\n\n")
        return b"".join(parts)

    def _chat_usage_frames(self, data: str, final: bool) -> list[bytes]:
        """OpenAI `include_usage`: usage goes in its own final chunk with empty `choices`."""
        chunk = orjson.loads(data)
        usage = chunk.pop("usage")
        if final and self._correct_usage and isinstance(usage, dict):
            set_cached(self.prepared.protocol, usage, self.prompt_tokens, self.cached_tokens)
        usage_chunk = {**chunk, "choices": [], "usage": usage}
        return [b"data: " + orjson.dumps(chunk) + b"\n\n", b"data: " + orjson.dumps(usage_chunk) + b"\n\n"]


class ResponseStream(_Framing):
    """One Chat, Responses or Messages request's output path, through deepseek-recipe's
    StreamProcessor (module doc)."""

    def __init__(self, prepared: PreparedRequest, bundle: TokenizerBundle, response_id: str):
        super().__init__(prepared, response_id)
        assert prepared.conversation is not None
        self._processor = dr.StreamProcessor(
            _generator(prepared, response_id), prepared.conversation.parsing_options, bundle.tokenizer
        )
        self._split_usage = prepared.protocol is ApiProtocol.CHAT and prepared.include_usage
        stops = list(prepared.conversation.parsing_options.stop_sequences)
        if stops:
            self._stop_guard = StopGuard(token_bytes(bundle.json_text), stops)

    def _processor_finished(self) -> bool:
        return bool(self._processor.finished)

    def ready(self, prompt_tokens: int, cached_tokens: int) -> bytes:
        self._start(prompt_tokens, cached_tokens)
        usage = dr.PromptUsage(prompt_tokens=prompt_tokens, prompt_cache_hit_tokens=cached_tokens)
        return self._emit(self._processor.push(dr.InferenceChunk.ready(prompt_usage=usage)))

    def _push(self, token_ids: list[int], logprobs: list[Any] | None) -> bytes:
        self.completion_tokens += len(token_ids)
        if logprobs is not None:
            pairs = [(float(lp), [(int(t), float(p)) for t, p in top]) for lp, top in logprobs]
            chunk = dr.InferenceChunk.tokens(token_ids, pairs)
        else:
            chunk = dr.InferenceChunk.tokens(token_ids)
        out = self._emit(self._processor.push(chunk))
        if self._processor.finished:  # a stop sequence matched: the parser already closed the answer
            out += self._done()
        return out

    def finish(self, reason: str, cached_tokens: int | None = None) -> bytes:
        """End normally (`stop`, `length`, `content_filter`); emits the usage chunk and `[DONE]`.
        `cached_tokens`: the worker's final count when `ready`'s was provisional (vLLM); every
        usage reported from here on (and a non-streaming body's) carries it."""
        if self.done:
            return b""
        self._final_cached(cached_tokens)
        finish = dr.InferenceChunk.finish(_FINISH.get(reason, _FINISH["stop"]))
        out = self._emit(self._processor.push(finish), final=True)
        out += self._emit(self._processor.finish(), final=True)
        return out + self._done()


class LegacyCompletionStream(_Framing):
    """One legacy Completions request's output path: completion_stream.py's processor and
    response in place of deepseek-recipe's; its usage is built at the end from the final
    cached count, so no JSON is corrected."""

    _corrects_json = False

    def __init__(self, prepared: PreparedRequest, bundle: TokenizerBundle, response_id: str):
        super().__init__(prepared, response_id)
        table = token_bytes(bundle.json_text)
        options = prepared.legacy or LegacyOptions()
        self._processor = TextCompletionProcessor(table, options, response_id, prepared.requested_model,
                                                  prepared.created, prepared.include_usage)
        if options.stop:
            self._stop_guard = StopGuard(table, list(options.stop))

    def ready(self, prompt_tokens: int, cached_tokens: int) -> bytes:
        self._start(prompt_tokens, cached_tokens)
        return self._emit(self._processor.ready(prompt_tokens, cached_tokens))

    def _push(self, token_ids: list[int], logprobs: list[Any] | None) -> bytes:
        self.completion_tokens += len(token_ids)
        out = self._emit(self._processor.tokens(token_ids, logprobs))
        return out + self._done() if self._processor.finished else out

    def finish(self, reason: str, cached_tokens: int | None = None) -> bytes:
        """As ResponseStream.finish."""
        if self.done:
            return b""
        self._final_cached(cached_tokens)
        self._processor.cached_tokens = self.cached_tokens  # its usage is built at the end from this
        return self._emit(self._processor.finish(reason), final=True) + self._done()


AnyResponseStream = ResponseStream | LegacyCompletionStream


def response_stream(prepared: PreparedRequest, bundle: TokenizerBundle, response_id: str) -> AnyResponseStream:
    """The output path of `prepared`'s protocol."""
    if prepared.protocol is ApiProtocol.COMPLETIONS:
        return LegacyCompletionStream(prepared, bundle, response_id)
    return ResponseStream(prepared, bundle, response_id)
