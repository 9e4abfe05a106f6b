"""Client request -> one internal request (token ids + sampling + parsing options).

The only place a protocol payload is parsed ("parse at the edge, once"): deepseek-recipe
converts Chat Completions, Responses and Anthropic Messages into a ConversationRequest,
encodes the prompt with the tokenizer, resolves the images (images.py) and `max_tokens`
against the context limit (images counted at their image token count). Legacy
Completions (completions.py) have no chat template: raw text through the plain
tokenizer, or token ids. Downstream code reads `PreparedRequest` only.

Model names resolve through the catalog (model_catalog.py): an unknown name is a 404
`model_not_found`; an alias selects its served model and default thinking mode.
Anthropic's `max_tokens` is required here. Beside this core: conversion.py (protocol body
-> ConversationRequest and the checks the library leaves to the caller), offload.py (where
preparation runs), prepared.py (`PreparedRequest` and the other types, re-exported here).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import deepseek_recipe as dr
import orjson

from deepinfer_gateway.core.errors import BridgeError
from deepinfer_gateway.core.model_catalog import ModelCatalog
from deepinfer_gateway.core.protocol import Sampling
from deepinfer_gateway.recipe_bridge import completions as legacy
from deepinfer_gateway.recipe_bridge.conversion import (
    RawBody,
    RefusalsOf,
    conversion_options,
    convert,
    min_tokens_of,
    sampling_of,
)
from deepinfer_gateway.recipe_bridge.encoder import PromptEncoder
from deepinfer_gateway.recipe_bridge.fields import (
    COUNT_TOKENS_FIELDS,
    cache_salt_of,
    check_fields,
    session_of,
    top_k_of,
)
from deepinfer_gateway.recipe_bridge.images import ImageInputs, ImageRefused, ResolvedImages
from deepinfer_gateway.recipe_bridge.includes import NONE, includes_of, logprobs_asked
from deepinfer_gateway.recipe_bridge.offload import OFFLOAD_BODY_BYTES, OFFLOAD_ENV, PrepareOffload, parse_offload
from deepinfer_gateway.recipe_bridge.prepared import ApiProtocol, BridgeConfig, PreparedRequest, TokenCount

# Importers take the preparer's inputs, outputs and offload settings from here.
__all__ = ["OFFLOAD_BODY_BYTES", "OFFLOAD_ENV", "ApiProtocol", "BridgeConfig", "PreparedRequest", "RequestPreparer",
           "TokenCount", "parse_offload"]


class RequestPreparer:
    """Stateless apart from configuration, the (cached) prompt encoder and the offload
    thread (offload.py); share one per process."""

    def __init__(self, encoder: PromptEncoder, config: BridgeConfig = BridgeConfig(), *,
                 offload: str | None = None):
        self.encoder = encoder
        self.config = config
        self.catalog = ModelCatalog(config.model_names, config.model_aliases)
        # By default thinking mode: the one the gateway serves unless a name or the request says otherwise.
        self._options = {thinking: conversion_options(config, self.catalog.names, thinking)
                         for thinking in (True, False)}
        self.images = ImageInputs(config.images)
        self._offload = PrepareOffload(offload, image_slots=config.images.max_concurrent)
        self.offload = self._offload.mode

    async def prepare_async(self, protocol: ApiProtocol, body: bytes) -> PreparedRequest:
        """`prepare`, off the event loop when it may take long: images (fetch, decode, resize)
        or a large prompt (tokenizing ~100k tokens cold takes tens of ms, which would stall
        every other stream's tokens on this loop)."""
        return await self._offload.run(self.prepare, protocol, body)

    async def count_tokens_async(self, body: bytes) -> TokenCount:
        """`count_tokens`, off the event loop like `prepare_async`."""
        return await self._offload.run(self.count_tokens, body)

    def prepare(self, protocol: ApiProtocol, body: bytes) -> PreparedRequest:
        if protocol is ApiProtocol.COMPLETIONS:
            return self._prepare_completion(body)
        raw = RawBody(body)
        parsed = raw.parsed  # every field is checked (fields.py): nothing accepted and ignored
        check_fields(protocol, parsed)
        includes = includes_of(parsed.get("include")) if protocol is ApiProtocol.RESPONSES else NONE
        if protocol is ApiProtocol.CHAT and _newer_chat_spellings(parsed):
            raw = RawBody(orjson.dumps(parsed))
        requested, target, conv, echo, namespace_map = convert(protocol, raw, self.catalog, self._options)
        with RefusalsOf(target.served):
            if protocol is ApiProtocol.MESSAGES and conv.inference_options.max_tokens is None:
                raise BridgeError(400, "max_tokens: Field required", param="max_tokens")
            images = self._images(conv.conversation)
            token_ids, packed_tokens = self._encode(conv)
            try:
                max_tokens = conv.resolve_max_tokens(len(token_ids) + images.token_adjustment,
                                                     self.config.context_limit)
            except dr.ConversionError as exc:
                raise BridgeError.from_conversion(exc) from None
            logprobs = None
            if protocol is ApiProtocol.RESPONSES:  # asked for by `include`, which deepseek-recipe does not read
                logprobs = logprobs_asked(includes, conv.inference_options.top_logprobs)
        stream_options = parsed.get("stream_options")
        include_usage = bool(isinstance(stream_options, dict) and stream_options.get("include_usage"))
        user = session_of(protocol, parsed)
        return PreparedRequest(
            protocol=protocol,
            model=target.served,
            requested_model=requested,
            conversation=conv,
            token_ids=token_ids,
            # `ignore_eos` (vLLM/SGLang extension): benchmarks replaying a trace's output lengths.
            sampling=sampling_of(conv, max_tokens, parsed.get("ignore_eos") is True,
                                 min_tokens_of(parsed.get("min_tokens"), max_tokens), top_k_of(parsed.get("top_k")),
                                 logprobs),
            stream=conv.stream,
            include_usage=include_usage,
            responses_echo=echo,
            namespace_tool_map=namespace_map,
            user=user,
            images=images.images,
            image_token_adjustment=images.token_adjustment,
            packed_tokens=packed_tokens,
            cache_salt=cache_salt_of(parsed.get("cache_salt")),
            service_tier=parsed.get("service_tier"),
        )

    def warm_up(self) -> None:
        """Prepare one small chat request (a system prompt, a tool, a user turn) so the first
        client's request does not pay the one-time set-up of the tokenizer (its tables, built on
        its first call, and the thread pool of its batch call) and the renderer: ~18 ms on a quiet
        2-core box, 60-140 ms on a loaded one (bench/first_request.py). Call it before the
        process listens."""
        self.prepare(ApiProtocol.CHAT, orjson.dumps({
            "model": self.config.model_names[0], "max_tokens": 1,
            "tools": [{"type": "function", "function": {"name": "read_file", "parameters": {"type": "object"}}}],
            "messages": [{"role": "system", "content": "You are a coding agent."},
                         {"role": "user", "content": "Read README.md and say what it is for."}],
        }))

    def count_tokens(self, body: bytes) -> TokenCount:
        """Anthropic `count_tokens`: the prompt tokens the engine would prefill for this
        Messages body's prompt fields (COUNT_TOKENS_FIELDS; `max_tokens` is not needed)."""
        raw = RawBody(body)
        check_fields(ApiProtocol.MESSAGES, raw.parsed, COUNT_TOKENS_FIELDS)
        requested, target, conv, _, _ = convert(ApiProtocol.MESSAGES, raw, self.catalog, self._options)
        with RefusalsOf(target.served):
            images = self._images(conv.conversation)
            token_ids, _ = self._encode(conv)
        return TokenCount(target.served, requested, len(token_ids) + images.token_adjustment)

    def _encode(self, conv: dr.ConversationRequest) -> tuple[Sequence[int], bytes | None]:
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
        with RefusalsOf(target.served):
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
            top_k=top_k_of(request.top_k),
            min_tokens=min_tokens_of(request.min_tokens, max_tokens),
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
            cache_salt=request.cache_salt,
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


def _newer_chat_spellings(parsed: dict[str, Any]) -> bool:
    """Rewrite, in place, what newer OpenAI clients send and deepseek-recipe 0.2 reads under an
    older name: `max_completion_tokens` (for the deprecated `max_tokens`) and the `developer`
    role (OpenAI's name for system instructions since its reasoning models). True if changed."""
    changed = False
    if parsed.get("max_tokens") is None and "max_completion_tokens" in parsed:
        parsed["max_tokens"] = parsed.pop("max_completion_tokens")
        changed = True
    messages = parsed.get("messages")
    if isinstance(messages, list):
        for message in messages:
            if isinstance(message, dict) and message.get("role") == "developer":
                message["role"] = "system"
                changed = True
    return changed
