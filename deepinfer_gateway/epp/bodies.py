"""What the EPP reads from a request and its response: which client protocol a path speaks,
and the cached-token count an engine reports in its usage (any protocol, streamed or not).

The request body is prepared by recipe_bridge's `RequestPreparer`, the front end's own
path, so the block hashes the EPP looks up are the ones the engine's KV events announce.
The response is passed on untouched; `UsageScanner` only reads it, chunk by chunk, for the
last `cached_tokens` (OpenAI chat/completions/Responses) or `cache_read_input_tokens`
(Anthropic) figure, so a usage split across two chunks is still read.
"""

from __future__ import annotations

import re

from deepinfer_gateway.gateway.http.routes import GENERATION_ROUTES
from deepinfer_gateway.recipe_bridge.prepared import ApiProtocol

_CACHED = re.compile(rb'"(?:cached_tokens|cache_read_input_tokens)"\s*:\s*(\d+)')
_OVERLAP = 64  # bytes of the previous chunk kept: longer than one `"cache_read_input_tokens": N` field


def path_protocol(path: str) -> ApiProtocol | None:
    """The generation protocol of a request path (query string ignored); None for any other path."""
    return GENERATION_ROUTES.get(path.split("?", 1)[0])


class UsageScanner:
    """The last cached-token figure seen in a response body fed chunk by chunk (a match found
    again in the kept tail is the same figure, and later ones come after it)."""

    __slots__ = ("_tail", "cached")

    def __init__(self) -> None:
        self._tail = b""
        self.cached: int | None = None

    def feed(self, chunk: bytes) -> None:
        window = self._tail + chunk
        for match in _CACHED.finditer(window):
            self.cached = int(match.group(1))
        self._tail = window[-_OVERLAP:]
