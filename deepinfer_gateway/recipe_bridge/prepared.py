"""The gateway's internal request and the names it is built from: which client protocol
(`ApiProtocol`), the bridge's configuration (`BridgeConfig`), the result of preparation
(`PreparedRequest`, the only form downstream code reads) and of counting (`TokenCount`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, NamedTuple

import deepseek_recipe as dr

from deepinfer_gateway.config import ImageSettings
from deepinfer_gateway.core.model_catalog import BUILTIN_ALIASES, ModelAlias
from deepinfer_gateway.core.protocol import DEFAULT_MODEL, Sampling
from deepinfer_gateway.recipe_bridge import completions as legacy


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


@dataclass
class PreparedRequest:
    protocol: ApiProtocol
    model: str  # the served name: metrics, usage, allow-lists
    conversation: dr.ConversationRequest | None  # None for legacy completions
    token_ids: Sequence[int]  # the encoder's `PackedIds`, or a list
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
    cache_salt: str | None = None  # the client's `cache_salt` (gateway/serving/cache_salt.py combines it)
    service_tier: str | None = None  # what the client asked for (OpenAI's or Anthropic's field)
    service_tier_echo: str | None = None  # the tier it ran at, echoed in the answer (OpenAI protocols)

    def __post_init__(self) -> None:
        self.requested_model = self.requested_model or self.model

    @property
    def prompt_tokens(self) -> int:
        """What the engine will prefill: token ids plus the image token adjustment (routing, limits)."""
        return len(self.token_ids) + self.image_token_adjustment


class TokenCount(NamedTuple):
    model: str  # served name
    requested_model: str
    input_tokens: int
