"""Legacy Completions (`POST /v1/completions`): the request model and its preparation.

deepseek-recipe has no Completions converter, and the API has no chat template: the
prompt is raw text, tokenized with the plain tokenizer (`Tokenizer.encode`, full
vocabulary, so a special-token spelling in the text becomes that token), or token ids
given by the client. One prompt, one choice: `n`/`best_of` > 1, `echo` and `suffix` are
refused with a 400 naming the parameter. `max_tokens` defaults to 16 (the API's
default) and is checked against the context limit like the chat protocols.

The response side (text, logprobs, stop sequences, usage) is completion_stream.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
)

DEFAULT_MAX_TOKENS = 16
MAX_STOP_SEQUENCES = 4

TokenIds = list[Annotated[StrictInt, Field(ge=0)]]


class _StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = False


class CompletionRequest(BaseModel):
    """The OpenAI legacy Completions body; an unknown field is refused (nothing accepted and ignored)."""

    model_config = ConfigDict(extra="forbid")

    model: StrictStr
    prompt: StrictStr | TokenIds | list[StrictStr] | list[TokenIds]
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    n: Annotated[StrictInt, Field(ge=1)] | None = None
    best_of: Annotated[StrictInt, Field(ge=1)] | None = None
    stream: StrictBool | None = False
    stream_options: _StreamOptions | None = None
    stop: StrictStr | list[StrictStr] | None = None
    seed: Annotated[StrictInt, Field(ge=0, lt=2**63)] | None = None
    logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None
    echo: StrictBool | None = False
    suffix: StrictStr | None = None
    user: StrictStr | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    ignore_eos: StrictBool = False  # vLLM/SGLang extension (benchmarks)
    top_k: StrictInt | None = None  # vLLM/SGLang extension
    min_tokens: Annotated[StrictInt, Field(ge=0)] | None = None  # vLLM/SGLang extension
    cache_salt: Annotated[StrictStr, Field(min_length=1, max_length=256)] | None = None  # vLLM extension


class CompletionRefused(Exception):
    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


@dataclass(frozen=True)
class LegacyOptions:
    """What the response side needs beyond the sampling parameters."""

    stop: tuple[str, ...] = ()
    logprobs: int | None = None  # top alternatives per token; None: no logprobs


def parse_completion(body: bytes) -> CompletionRequest:
    try:
        request = CompletionRequest.model_validate_json(body)
    except ValidationError as exc:
        error = exc.errors(include_url=False)[0]
        param = ".".join(str(p) for p in error["loc"]) or None
        if error["type"] == "extra_forbidden":
            raise CompletionRefused(f"Unrecognized request argument supplied: {param}", param) from None
        raise CompletionRefused(f"Invalid request: {param}: {error['msg']}" if param else error["msg"], param) from None
    for name in ("n", "best_of"):
        if (getattr(request, name) or 1) > 1:
            raise CompletionRefused(f"`{name}` > 1 is not supported: send one request per completion.", name)
    if request.echo:
        raise CompletionRefused("`echo` is not supported.", "echo")
    for name in ("frequency_penalty", "presence_penalty"):
        if getattr(request, name):
            raise CompletionRefused(f"`{name}` is not supported: DeepInfer's sampler has no such control; only 0 "
                                    "is accepted.", name)
    if request.suffix:
        raise CompletionRefused("`suffix` (insertion) is not supported.", "suffix")
    stops = stop_sequences(request.stop)
    if len(stops) > MAX_STOP_SEQUENCES or any(not s for s in stops):
        raise CompletionRefused(f"`stop` takes up to {MAX_STOP_SEQUENCES} non-empty strings.", "stop")
    return request


def stop_sequences(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


def single_prompt(prompt: str | list[int] | list[str] | list[list[int]]) -> str | list[int]:
    """The one prompt of the request (text or token ids); batches of several are refused."""
    if isinstance(prompt, str):
        return prompt
    if prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise CompletionRefused("Batched prompts are not supported: send one prompt per request.", "prompt")
        only: str | list[int] = prompt[0]
        return only
    return list(prompt)  # type: ignore[arg-type]


def context_error(context_limit: int, prompt_tokens: int, max_tokens: int) -> CompletionRefused:
    return CompletionRefused(
        f"This model's maximum context length is {context_limit} tokens. However, you requested "
        f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the prompt, {max_tokens} in the completion). "
        "Please reduce the length of the prompt or completion.",
        "max_tokens" if max_tokens else "prompt",
    )


def resolve_max_tokens(requested: int | None, prompt_tokens: int, context_limit: int) -> int:
    if requested is not None:
        if prompt_tokens + requested > context_limit:
            raise context_error(context_limit, prompt_tokens, requested)
        return requested
    if prompt_tokens >= context_limit:
        raise context_error(context_limit, prompt_tokens, 0)
    return min(DEFAULT_MAX_TOKENS, context_limit - prompt_tokens)
