"""Worker protocol <-> DeepInfer value translation (pure functions, no engine state)."""

from __future__ import annotations

from typing import Any

from deepinfer_gateway.core.protocol import ErrorKind, FinishReason, Sampling

# DeepInfer finish-reason strings (csrc/engine/sequence.hpp get_finished_reason).
_ERRORS: dict[str, tuple[ErrorKind, str]] = {
    "prompt_length_exceeded": (ErrorKind.PROMPT_TOO_LONG, "prompt is longer than the engine accepts"),
    "insufficient_system_resource": (ErrorKind.RESOURCE_EXHAUSTED, "KV cache about to overflow: request preempted"),
    "xgrammar runtime errors or timeout": (
        ErrorKind.STRUCTURED_OUTPUT,
        "structured output grammar failed or timed out",
    ),
    "ve_error": (ErrorKind.VISION_ENCODER, "vision encoder failed on this request's images"),
}
_PLAIN = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}


def map_finish(reason: str) -> tuple[FinishReason, ErrorKind | None, str | None]:
    """(protocol reason, error kind, message) for a DeepInfer finish-reason string."""
    if reason in _PLAIN:
        return _PLAIN[reason], None, None
    if reason in _ERRORS:
        kind, message = _ERRORS[reason]
        return FinishReason.ERROR, kind, message
    if "xgrammar" in reason:  # the string is free text in the engine; match loosely
        return FinishReason.ERROR, ErrorKind.STRUCTURED_OUTPUT, reason
    return FinishReason.ERROR, ErrorKind.ENGINE, f"unknown DeepInfer finish reason {reason!r}"


def sampling_kwargs(sampling: Sampling) -> dict[str, Any]:
    """Keyword arguments for `deepinfer.SamplingParams` (whose names `Sampling` mirrors).

    `logprobs` is not passed (DeepInfer ignores it; token logprobs come with every
    output) and `stop_token_ids` has no DeepInfer counterpart: the wrapper enforces it.
    """
    kwargs: dict[str, Any] = {
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "max_tokens": sampling.max_tokens,
        "ignore_eos": sampling.ignore_eos,
        "top_logprobs": sampling.top_logprobs,
        "seq_seed": sampling.seq_seed,
    }
    if sampling.so_args is not None:
        kwargs["so_args"] = {"schema_type": sampling.so_args.schema_type, "schema": sampling.so_args.schema_}
    return kwargs
