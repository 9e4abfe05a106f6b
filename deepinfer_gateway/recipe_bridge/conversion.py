"""Chat Completions, Responses and Anthropic Messages bodies -> a deepseek-recipe
ConversationRequest, with the checks the library leaves to the caller.

Checks are made on the raw body (`RawBody`) only when its bytes can hold what is checked:
a forced tool choice without a thinking request is served without thinking; Anthropic's
refusal of a `system` message role. Bridge errors raised under `RefusalsOf` carry the
served model. Legacy Completions have no conversation and are not converted here.
"""

from __future__ import annotations

import re
from typing import Any

import deepseek_recipe as dr
import orjson

from deepinfer_gateway.core.errors import BridgeError
from deepinfer_gateway.core.model_catalog import ModelCatalog, ModelTarget
from deepinfer_gateway.core.protocol import Sampling, StructuredOutput
from deepinfer_gateway.recipe_bridge.prepared import ApiProtocol, BridgeConfig

REQUEST_TYPES: dict[ApiProtocol, Any] = {
    ApiProtocol.CHAT: dr.ChatCompletionRequest,
    ApiProtocol.RESPONSES: dr.ResponsesRequest,
    ApiProtocol.MESSAGES: dr.MessagesRequest,
}


def conversion_options(config: BridgeConfig, names: tuple[str, ...], thinking: bool) -> dr.ConversionOptions:
    options = (
        dr.ConversionOptions()
        .with_default_thinking_mode(thinking)
        .with_thinking_max_tokens_upper_bound(config.max_tokens_upper_bound)
        .with_non_thinking_max_tokens_upper_bound(config.max_tokens_upper_bound)
    )
    return options.with_model_versions_by_name({name: dr.ModelVersion.DeepseekV41Flash for name in names})


def sampling_of(conv: dr.ConversationRequest, max_tokens: int, ignore_eos: bool, min_tokens: int = 0,
                top_k: int = -1, logprobs: tuple[bool, int] | None = None) -> Sampling:
    """The engine's sampling; `logprobs`: (asked for, alternatives per token) where the protocol
    says so outside the options deepseek-recipe reads (Responses' `include`)."""
    opts = conv.inference_options
    wants_logprobs, top_logprobs = (opts.logprobs, opts.top_logprobs or 0) if logprobs is None else logprobs
    constraint = opts.output_constraint
    so_args = StructuredOutput(schema_type=constraint.kind, schema_=constraint.schema) if constraint else None
    return Sampling(
        temperature=opts.temperature if opts.temperature is not None else 1.0,
        top_p=opts.top_p if opts.top_p is not None else 1.0,
        top_k=top_k,
        max_tokens=max_tokens,
        logprobs=wants_logprobs,
        top_logprobs=top_logprobs,
        seq_seed=opts.seed,
        so_args=so_args,
        ignore_eos=ignore_eos,
        min_tokens=min_tokens,
    )


def min_tokens_of(value: Any, max_tokens: int) -> int:
    """`min_tokens` (vLLM/SGLang extension): an integer from 0 to the request's max_tokens."""
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= max_tokens:
        raise BridgeError(400, f"min_tokens must be an integer from 0 to max_tokens ({max_tokens}).",
                          param="min_tokens")
    return value


class RawBody:
    """The raw request body, parsed in Python at most once (the field check reads every body:
    ~0.7 ms for a 500 kB conversation, which deepseek-recipe parses again in Rust)."""

    def __init__(self, raw: bytes):
        self.raw = raw
        self._parsed: dict[str, Any] | None = None

    @property
    def parsed(self) -> dict[str, Any]:
        if self._parsed is None:
            try:
                parsed = orjson.loads(self.raw)
            except orjson.JSONDecodeError:
                parsed = {}  # deepseek-recipe reports the malformed body in its own words
            self._parsed = parsed if isinstance(parsed, dict) else {}
        return self._parsed

    def forces_tool(self) -> bool:
        """tool_choice `required`, a named function (OpenAI) or `any` / a named tool (Anthropic)."""
        if b'"tool_choice"' not in self.raw:
            return False
        choice = self.parsed.get("tool_choice")
        return choice == "required" or (isinstance(choice, dict) and choice.get("type") in ("function", "tool", "any"))

    def has_system_message(self) -> bool:
        if _SYSTEM_ROLE.search(self.raw) is None:
            return False
        messages = self.parsed.get("messages")
        return isinstance(messages, list) and any(isinstance(m, dict) and m.get("role") == "system" for m in messages)


_SYSTEM_ROLE = re.compile(rb'"role"\s*:\s*"system"')  # ~0.4 ms per 500 kB; a hit is confirmed on the parse
_LIBRARY_FORCED_TOOL_IN_THINKING = "Thinking mode does not support this tool_choice"


class RefusalsOf:  # a class: @contextmanager costs ~2 us per request
    """Bridge errors raised inside carry the served model, the request's metrics label."""

    __slots__ = ("model",)

    def __init__(self, model: str):
        self.model = model

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: object, exc: BaseException | None, tb: object) -> None:
        if isinstance(exc, BridgeError) and exc.model is None:
            exc.model = self.model


def _forced_tool_in_thinking() -> BridgeError:
    return BridgeError(400, "Thinking mode does not support a forced tool_choice: drop the thinking request (the "
                            "request is then served without thinking) or use tool_choice auto or none.",
                       param="tool_choice")


def convert(protocol: ApiProtocol, body: RawBody, catalog: ModelCatalog,
            options_by_thinking: dict[bool, dr.ConversionOptions]
            ) -> tuple[str, ModelTarget, dr.ConversationRequest, Any, dict[str, tuple[str, str]] | None]:
    """A Chat, Responses or Messages body -> (requested name, its target, the conversation,
    Responses echo, Responses namespace map); `options_by_thinking` keyed by thinking mode."""
    try:
        request = REQUEST_TYPES[protocol](body.raw)
    except dr.ConversionError as exc:
        raise BridgeError.from_conversion(exc) from None
    except ValueError as exc:  # malformed body the library cannot even read
        raise BridgeError(400, str(exc)) from None
    requested = request.model
    target = catalog.resolve(requested)
    if target is None:
        raise BridgeError.model_not_found(requested)
    with RefusalsOf(target.served):
        if protocol is ApiProtocol.MESSAGES and body.has_system_message():
            raise BridgeError(400, 'messages: Unexpected role "system". The Messages API accepts a top-level '
                                   '`system` parameter, not "system" as an input message role.',
                              param="messages")
        forced_tool = body.forces_tool()
        # A forced tool choice is served without thinking unless the request itself asks
        # for thinking: the library then refuses the combination (docs/api.md).
        options = options_by_thinking[False if forced_tool else target.thinking is not False]
        try:
            echo = namespace_map = None
            if protocol is ApiProtocol.RESPONSES:
                echo = request.echo()
                namespace_map = request.namespace_tool_map(options)
            conv = request.convert(options)
        except dr.ConversionError as exc:
            error = BridgeError.from_conversion(exc)
            if error.message == _LIBRARY_FORCED_TOOL_IN_THINKING:
                raise _forced_tool_in_thinking() from None
            raise error from None
        except ValueError as exc:
            raise BridgeError(400, str(exc)) from None
        if forced_tool and conv.conversation.thinking_mode:  # what the library lets through (Anthropic `any`)
            raise _forced_tool_in_thinking()
    return requested, target, conv, echo, namespace_map
