"""Engine tokens -> OpenAI `text_completion` chunks / response (legacy Completions).

The counterpart of deepseek-recipe's StreamProcessor + XResponse for a protocol the
library does not cover, with the same shape so ResponseStream frames both alike:
`TextCompletionProcessor` turns ready / tokens / finish into chunks (objects with
`to_json()`), `TextCompletionResponse` accumulates them into the non-streaming body.

Text is decoded incrementally (detokenizer.TextDecoder). Stop sequences are matched on
the decoded text: text that could still be the start of a stop sequence is held back
until it can be told apart, so no part of a stop sequence ever reaches the client; a
match ends the answer (`finished`, finish_reason `stop`) and the caller aborts the engine.
Logprobs use the legacy shape (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`),
one entry per engine token in the chunk that carried it.
"""

from __future__ import annotations

from typing import Any

import orjson

from deepinfer_gateway.recipe_bridge.completions import LegacyOptions
from deepinfer_gateway.recipe_bridge.detokenizer import TextDecoder, TokenBytes

OBJECT = "text_completion"


class Chunk:
    __slots__ = ("data",)

    def __init__(self, data: dict[str, Any]):
        self.data = data

    def to_json(self) -> str:
        return orjson.dumps(self.data).decode()


def usage_of(prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
        "prompt_cache_hit_tokens": cached_tokens,
        "prompt_cache_miss_tokens": prompt_tokens - cached_tokens,
    }


class TextCompletionProcessor:
    def __init__(self, table: TokenBytes, options: LegacyOptions, response_id: str, model: str, created: int,
                 include_usage: bool):
        self._table = table
        self._decoder = TextDecoder(table)
        self._stops = options.stop
        self._top = options.logprobs
        self._head = {"id": response_id, "object": OBJECT, "created": created, "model": model}
        self._include_usage = include_usage
        self._held = ""
        self._offset = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.completion_tokens = 0
        self.finished = False

    # --- inputs -----------------------------------------------------------------------

    def ready(self, prompt_tokens: int, cached_tokens: int) -> list[Chunk]:
        self.prompt_tokens, self.cached_tokens = prompt_tokens, cached_tokens
        return []

    def tokens(self, token_ids: list[int], logprobs: list[Any] | None) -> list[Chunk]:
        if self.finished:
            return []
        self.completion_tokens += len(token_ids)
        lp = self._logprobs(token_ids, logprobs) if self._top is not None and logprobs is not None else None
        return self._text(self._decoder.decode(token_ids), lp)

    def finish(self, reason: str) -> list[Chunk]:
        if self.finished:
            return []
        text = self._held + self._decoder.flush()
        self._held = ""
        out = [self._chunk(text, None)] if text else []
        return out + self._end(reason if reason in ("stop", "length", "content_filter") else "stop")

    # --- outputs ----------------------------------------------------------------------

    def _text(self, text: str, lp: dict[str, Any] | None) -> list[Chunk]:
        if not self._stops:
            return [self._chunk(text, lp)] if text or lp else []
        buf = self._held + text
        hits = [i for i in (buf.find(s) for s in self._stops) if i >= 0]
        if hits:
            self._held = ""
            head = buf[: min(hits)]
            return ([self._chunk(head, lp)] if head or lp else []) + self._end("stop")
        keep = max((n for s in self._stops for n in range(min(len(s) - 1, len(buf)), 0, -1)
                    if buf.endswith(s[:n])), default=0)
        self._held = buf[len(buf) - keep:] if keep else ""
        out = buf[: len(buf) - keep]
        return [self._chunk(out, lp)] if out or lp else []

    def _chunk(self, text: str, lp: dict[str, Any] | None, finish: str | None = None) -> Chunk:
        choice = {"index": 0, "text": text, "logprobs": lp, "finish_reason": finish}
        return Chunk({**self._head, "choices": [choice]})

    def _end(self, reason: str) -> list[Chunk]:
        self.finished = True
        out = [self._chunk("", None, reason)]
        usage = usage_of(self.prompt_tokens, self.cached_tokens, self.completion_tokens)
        if self._include_usage:
            out.append(Chunk({**self._head, "choices": [], "usage": usage}))
        else:
            out[0].data["usage"] = usage
        return out

    def _logprobs(self, token_ids: list[int], logprobs: list[Any]) -> dict[str, Any]:
        text_of = self._table.text_of
        tokens = [text_of(t) for t in token_ids]
        offsets = []
        for token in tokens:
            offsets.append(self._offset)
            self._offset += len(token)
        top = [{text_of(int(t)): float(p) for t, p in alternatives[: self._top]} for _, alternatives in logprobs]
        return {"tokens": tokens, "token_logprobs": [float(lp) for lp, _ in logprobs],
                "top_logprobs": top if self._top else None, "text_offset": offsets}


class TextCompletionResponse:
    """The non-streaming body, accumulated from the processor's chunks."""

    def __init__(self, response_id: str, model: str, created: int, prompt_tokens: int, cached_tokens: int):
        self._head = {"id": response_id, "object": OBJECT, "created": created, "model": model}
        self._text: list[str] = []
        self._logprobs: dict[str, list[Any] | None] | None = None
        self._finish: str | None = None
        self._usage = usage_of(prompt_tokens, cached_tokens, 0)

    def accumulate(self, chunk: Chunk) -> None:
        data = chunk.data
        if data.get("usage"):
            self._usage = data["usage"]
        for choice in data["choices"]:
            self._text.append(choice["text"])
            self._finish = choice["finish_reason"] or self._finish
            lp = choice["logprobs"]
            if lp:
                if self._logprobs is None:
                    self._logprobs = {key: [] for key in lp}
                for key, values in lp.items():
                    kept = self._logprobs[key]
                    if values is None:
                        self._logprobs[key] = None
                    elif kept is not None:
                        kept.extend(values)

    @staticmethod
    def sse_event_name(chunk: Chunk) -> str | None:
        return None

    @staticmethod
    def sse_done_data() -> str | None:
        return "[DONE]"

    def to_json(self) -> str:
        choice = {"index": 0, "text": "".join(self._text), "logprobs": self._logprobs,
                  "finish_reason": self._finish or "stop"}
        return orjson.dumps({**self._head, "choices": [choice], "usage": self._usage}).decode()
