"""Client request -> one internal request (token ids + sampling + parsing options).

The only place a protocol payload is parsed ("parse at the edge, once"): deepseek-recipe
converts Chat Completions, Responses and Anthropic Messages into a ConversationRequest,
encodes the prompt with the tokenizer, resolves the images (images.py) and `max_tokens`
against the context limit (images counted at their image token count). Legacy
Completions (completions.py) have no chat template: raw text through the plain
tokenizer, or token ids. Downstream code reads `PreparedRequest` only.

Model names resolve through the catalog (model_catalog.py): an unknown name is a 404
`model_not_found`; an alias selects its served model and default thinking mode. Checks
the library leaves to the caller are made here, on the raw body only when its bytes can
hold what is checked: a forced tool choice without a thinking request is served without
thinking; Anthropic's required `max_tokens` and its refusal of a `system` message role.
"""

from __future__ import annotations

import asyncio
import os
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, NamedTuple

import deepseek_recipe as dr
import orjson

from deepinfer_gateway.config import ImageSettings
from deepinfer_gateway.errors import BridgeError
from deepinfer_gateway.model_catalog import BUILTIN_ALIASES, ModelAlias, ModelCatalog, ModelTarget
from deepinfer_gateway.protocol import DEFAULT_MODEL, Sampling, StructuredOutput
from deepinfer_gateway.recipe_bridge import completions as legacy
from deepinfer_gateway.recipe_bridge.encoder import PromptEncoder
from deepinfer_gateway.recipe_bridge.images import (
    ImageInputs,
    ImageRefused,
    ResolvedImages,
)


class ApiProtocol(StrEnum):
    CHAT = "chat"
    RESPONSES = "responses"
    MESSAGES = "messages"
    COMPLETIONS = "completions"  # legacy text completions: no chat template


@dataclass(frozen=True)
class BridgeConfig:
    model_names: tuple[str, ...] = (DEFAULT_MODEL,)
    model_aliases: dict[str, ModelAlias] = field(default_factory=lambda: dict(BUILTIN_ALIASES))
    context_limit: int = 131_072
    max_tokens_upper_bound: int = 393_216
    images: ImageSettings = field(default_factory=ImageSettings)


_REQUEST_TYPES: dict[ApiProtocol, Any] = {
    ApiProtocol.CHAT: dr.ChatCompletionRequest,
    ApiProtocol.RESPONSES: dr.ResponsesRequest,
    ApiProtocol.MESSAGES: dr.MessagesRequest,
}


@dataclass
class PreparedRequest:
    protocol: ApiProtocol
    model: str  # the served name: metrics, usage, allow-lists
    conversation: dr.ConversationRequest | None  # None for legacy completions
    token_ids: list[int]
    sampling: Sampling
    stream: bool
    include_usage: bool
    created: int = field(default_factory=lambda: int(time.time()))
    # Responses only: settings echoed back and namespace tool names.
    responses_echo: Any = None
    namespace_tool_map: dict[str, tuple[str, str]] | None = None
    user: str | None = None
    # Images: base64 preprocessed bytes, prompt order, and the tokens they add beyond one placeholder each.
    images: list[str] = field(default_factory=list)
    image_token_adjustment: int = 0
    legacy: legacy.LegacyOptions | None = None  # legacy completions: stop sequences, logprobs
    packed_tokens: bytes | None = None  # token_ids packed for block hashing, when the encoder had them
    requested_model: str = ""  # the name the client sent (an alias or `model`), echoed in responses

    def __post_init__(self) -> None:
        self.requested_model = self.requested_model or self.model

    @property
    def prompt_tokens(self) -> int:
        """What the engine will prefill: token ids plus the image token adjustment (routing, limits)."""
        return len(self.token_ids) + self.image_token_adjustment

    def worker_fields(self) -> dict[str, object]:
        """Extra GenerateRequest fields for the worker body (images), empty without images."""
        if not self.images:
            return {}
        return {"images": self.images, "image_token_adjustment": self.image_token_adjustment}


class TokenCount(NamedTuple):
    model: str  # served name
    requested_model: str
    input_tokens: int


def _conversion_options(config: BridgeConfig, names: tuple[str, ...], thinking: bool) -> dr.ConversionOptions:
    options = (
        dr.ConversionOptions()
        .with_default_thinking_mode(thinking)
        .with_thinking_max_tokens_upper_bound(config.max_tokens_upper_bound)
        .with_non_thinking_max_tokens_upper_bound(config.max_tokens_upper_bound)
    )
    return options.with_model_versions_by_name({name: dr.ModelVersion.DeepseekV41Flash for name in names})


def _sampling(conv: dr.ConversationRequest, max_tokens: int, ignore_eos: bool) -> Sampling:
    opts = conv.inference_options
    constraint = opts.output_constraint
    so_args = StructuredOutput(schema_type=constraint.kind, schema=constraint.schema) if constraint else None
    return Sampling(
        temperature=opts.temperature if opts.temperature is not None else 1.0,
        top_p=opts.top_p if opts.top_p is not None else 1.0,
        max_tokens=max_tokens,
        logprobs=opts.logprobs,
        top_logprobs=opts.top_logprobs or 0,
        seq_seed=opts.seed,
        so_args=so_args,
        ignore_eos=ignore_eos,
    )


# Top-level fields deepseek-recipe does not surface. The body is parsed in Python only when
# one of them may be present: a 500 kB conversation costs ~0.7 ms to parse, and the
# library parses it anyway. (`"user":` not `"user"`: every chat has `"role": "user"`.)
_EXTRA_KEYS = (b'"stream_options"', b'"user":', b'"user" :', b'"ignore_eos"', b'"max_completion_tokens"')


class _Body:
    """The raw request body, parsed in Python at most once and only when a check needs it."""

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

    def extras(self) -> dict[str, Any]:
        return self.parsed if any(key in self.raw for key in _EXTRA_KEYS) else {}

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


class _RefusalsOf:  # a class: @contextmanager costs ~2 us per request
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


OFFLOAD_BODY_BYTES = 64 * 1024
# How bodies over OFFLOAD_BODY_BYTES are prepared: "thread" (default), one dedicated thread,
# with the GIL switch interval lowered to PREPARE_SWITCH_INTERVAL_S; "pool": asyncio's
# default executor (several at once; the behaviour before); "loop": inline. Bodies with
# images always go to the default executor. "MODE@MS" also sets the switch interval (ms).
# The environment variable overrides the default (bench/relay_under_prep.py compares them).
OFFLOAD_MODES = ("thread", "pool", "loop")
OFFLOAD_ENV = "DGW_PREPARE_OFFLOAD"
PREPARE_SWITCH_INTERVAL_S = 0.0005


def parse_offload(spec: str) -> tuple[str, float | None]:
    """"MODE[@MS]" -> (mode, switch interval in s or None)."""
    mode, _, ms = spec.partition("@")
    if mode not in OFFLOAD_MODES:
        raise ValueError(f"preparation offload must be one of {OFFLOAD_MODES} (optionally @MS), not {spec!r}")
    return mode, (float(ms) / 1000 if ms else None)


class RequestPreparer:
    """Stateless apart from configuration and the (cached) prompt encoder; share one per process.

    Large bodies are prepared in ONE dedicated thread, one after another, and the process's
    GIL switch interval is lowered to 0.5 ms (from Python's 5 ms). Why (docs/simulate.md,
    bench/relay_under_prep.py): preparation holds the GIL for part of its work (JSON and
    template in the library, list building, packing; tiktoken's BPE releases it), and every
    time the event loop gives the GIL up for a socket call it waits up to one switch interval
    to get it back, several times per relayed token. With asyncio's default executor a burst
    of big prompts ran in several threads at once, each competing with the loop: every other
    stream's first token and inter-token gaps grew by tens to hundreds of ms. One thread keeps
    it to one competitor (a burst is prepared back to back: on a quiet machine its median
    prompt waits ~10% longer), and the short interval bounds each wait. Preparing inline on
    the loop is worse: the loop stops for the whole preparation (~60 ms per 80k tokens cold).
    The interval is process-wide; its cost was not measurable (docs/simulate.md).
    """

    def __init__(self, encoder: PromptEncoder, config: BridgeConfig = BridgeConfig(), *,
                 offload: str | None = None):
        self.encoder = encoder
        self.config = config
        self.catalog = ModelCatalog(config.model_names, config.model_aliases)
        # By default thinking mode: the one the gateway serves unless a name or the request says otherwise.
        self._options = {thinking: _conversion_options(config, self.catalog.names, thinking)
                         for thinking in (True, False)}
        self.images = ImageInputs(config.images)
        self.offload, switch_s = parse_offload(offload or os.environ.get(OFFLOAD_ENV) or "thread")
        if switch_s is not None:
            sys.setswitchinterval(switch_s)
        elif self.offload == "thread":
            sys.setswitchinterval(min(sys.getswitchinterval(), PREPARE_SWITCH_INTERVAL_S))
        # The thread starts on first use.
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="prepare") if self.offload == "thread" else None

    async def prepare_async(self, protocol: ApiProtocol, body: bytes) -> PreparedRequest:
        """`prepare`, off the event loop when it may take long: images (fetch, decode, resize)
        or a large prompt (tokenizing ~100k tokens cold takes tens of ms, which would stall
        every other stream's tokens on this loop)."""
        return await self._off_loop(self.prepare, protocol, body)

    async def count_tokens_async(self, body: bytes) -> TokenCount:
        """`count_tokens`, off the event loop like `prepare_async`."""
        return await self._off_loop(self.count_tokens, body)

    async def _off_loop(self, work: Any, *args: Any) -> Any:
        body: bytes = args[-1]
        if b"image" in body:  # may wait on remote fetches: never queue prompts behind them
            return await asyncio.to_thread(work, *args)
        if len(body) > OFFLOAD_BODY_BYTES and self.offload != "loop":
            if self._executor is None:
                return await asyncio.to_thread(work, *args)
            return await asyncio.get_running_loop().run_in_executor(self._executor, work, *args)
        return work(*args)

    def prepare(self, protocol: ApiProtocol, body: bytes) -> PreparedRequest:
        if protocol is ApiProtocol.COMPLETIONS:
            return self._prepare_completion(body)
        raw = _Body(body)
        parsed = raw.extras()
        if protocol is ApiProtocol.CHAT and parsed.get("max_tokens") is None and "max_completion_tokens" in parsed:
            # deepseek-recipe 0.2 reads only the deprecated `max_tokens`; the newer name means the same.
            parsed["max_tokens"] = parsed.pop("max_completion_tokens")
            raw = _Body(orjson.dumps(parsed))
        requested, target, conv, echo, namespace_map = self._convert(protocol, raw)
        with _RefusalsOf(target.served):
            if protocol is ApiProtocol.MESSAGES and conv.inference_options.max_tokens is None:
                raise BridgeError(400, "max_tokens: Field required", param="max_tokens")
            images = self._images(conv.conversation)
            token_ids, packed_tokens = self._encode(conv)
            try:
                max_tokens = conv.resolve_max_tokens(len(token_ids) + images.token_adjustment,
                                                     self.config.context_limit)
            except dr.ConversionError as exc:
                raise BridgeError.from_conversion(exc) from None
        stream_options = parsed.get("stream_options")
        include_usage = bool(isinstance(stream_options, dict) and stream_options.get("include_usage"))
        user = parsed.get("user") if isinstance(parsed.get("user"), str) else None
        return PreparedRequest(
            protocol=protocol,
            model=target.served,
            requested_model=requested,
            conversation=conv,
            token_ids=token_ids,
            # `ignore_eos` (vLLM/SGLang extension): benchmarks replaying a trace's output lengths.
            sampling=_sampling(conv, max_tokens, parsed.get("ignore_eos") is True),
            stream=conv.stream,
            include_usage=include_usage,
            responses_echo=echo,
            namespace_tool_map=namespace_map,
            user=user,
            images=images.images,
            image_token_adjustment=images.token_adjustment,
            packed_tokens=packed_tokens,
        )

    def count_tokens(self, body: bytes) -> TokenCount:
        """Anthropic `count_tokens`: the prompt tokens the engine would prefill for this
        Messages body (`max_tokens` is not needed)."""
        requested, target, conv, _, _ = self._convert(ApiProtocol.MESSAGES, _Body(body))
        with _RefusalsOf(target.served):
            images = self._images(conv.conversation)
            token_ids, _ = self._encode(conv)
        return TokenCount(target.served, requested, len(token_ids) + images.token_adjustment)

    def _convert(self, protocol: ApiProtocol, body: _Body
                 ) -> tuple[str, ModelTarget, dr.ConversationRequest, Any, dict[str, tuple[str, str]] | None]:
        """(requested name, its target, the conversation, Responses echo, Responses namespace map)."""
        try:
            request = _REQUEST_TYPES[protocol](body.raw)
        except dr.ConversionError as exc:
            raise BridgeError.from_conversion(exc) from None
        except ValueError as exc:  # malformed body the library cannot even read
            raise BridgeError(400, str(exc)) from None
        requested = request.model
        target = self.catalog.resolve(requested)
        if target is None:
            raise BridgeError.model_not_found(requested)
        with _RefusalsOf(target.served):
            if protocol is ApiProtocol.MESSAGES and body.has_system_message():
                raise BridgeError(400, 'messages: Unexpected role "system". The Messages API accepts a top-level '
                                       '`system` parameter, not "system" as an input message role.',
                                  param="messages")
            forced_tool = body.forces_tool()
            # A forced tool choice is served without thinking unless the request itself asks
            # for thinking: the library then refuses the combination (docs/api.md).
            options = self._options[False if forced_tool else target.thinking is not False]
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

    def _encode(self, conv: dr.ConversationRequest) -> tuple[list[int], bytes | None]:
        try:
            return self.encoder.encode_packed(conv.conversation)
        except RuntimeError as exc:  # text the vocabulary cannot encode
            raise BridgeError(400, f"The prompt cannot be tokenized: {exc}") from None

    def _images(self, conversation: dr.Conversation) -> ResolvedImages:
        try:
            return self.images.resolve(self.images.sources(conversation))
        except ImageRefused as exc:
            raise BridgeError(400, str(exc), param="messages") from None

    def _prepare_completion(self, body: bytes) -> PreparedRequest:
        try:
            request = legacy.parse_completion(body)
        except legacy.CompletionRefused as exc:
            raise BridgeError(400, exc.message, param=exc.param) from None
        target = self.catalog.resolve(request.model)
        if target is None:
            raise BridgeError.model_not_found(request.model)
        with _RefusalsOf(target.served):
            try:
                token_ids, max_tokens = self._completion_prompt(request)
            except legacy.CompletionRefused as exc:
                raise BridgeError(400, exc.message, param=exc.param) from None
        sampling = Sampling(
            temperature=request.temperature if request.temperature is not None else 1.0,
            top_p=request.top_p if request.top_p is not None else 1.0,
            max_tokens=max_tokens,
            logprobs=request.logprobs is not None,
            top_logprobs=request.logprobs or 0,
            seq_seed=request.seed,
            ignore_eos=request.ignore_eos,
        )
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        return PreparedRequest(
            protocol=ApiProtocol.COMPLETIONS,
            model=target.served,
            requested_model=request.model,
            conversation=None,
            token_ids=token_ids,
            sampling=sampling,
            stream=bool(request.stream),
            include_usage=include_usage,
            user=request.user,
            legacy=legacy.LegacyOptions(legacy.stop_sequences(request.stop), request.logprobs),
        )

    def _completion_prompt(self, request: legacy.CompletionRequest) -> tuple[list[int], int]:
        """(prompt token ids, resolved max_tokens) of a legacy completion; CompletionRefused otherwise."""
        prompt = legacy.single_prompt(request.prompt)
        bundle = self.encoder.bundle
        if isinstance(prompt, str):
            token_ids = bundle.tokenizer.encode(prompt)
        else:
            token_ids = prompt
            if any(t >= bundle.vocab_size for t in token_ids):
                raise legacy.CompletionRefused(
                    f"Token ids in `prompt` must be below the vocabulary size {bundle.vocab_size}.", "prompt")
        if not token_ids:
            raise legacy.CompletionRefused("`prompt` must not be empty.", "prompt")
        return token_ids, legacy.resolve_max_tokens(request.max_tokens, len(token_ids), self.config.context_limit)
