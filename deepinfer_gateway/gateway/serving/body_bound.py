"""The largest request body worth reading: one whose bytes could still fit the context.

A prompt of `context_limit` tokens is at most `context_limit` x the longest token's bytes of
text, and JSON writes a byte as at most 6 (`\\u00XX`); images come on top, base64. A body
beyond that cannot fit whatever it says, so it is refused (413) from its size alone, before
it is parsed or tokenized; `max_body_bytes`, when smaller, is the limit.
"""

from __future__ import annotations

from deepinfer_gateway.config import GatewaySettings

MAX_TOKEN_BYTES = 128  # the longest token of the DeepSeek vocabularies (byte-level BPE)
MAX_JSON_BYTES_PER_BYTE = 6  # "\u00XX"
STRUCTURE_BYTES = 1024 * 1024  # roles, field names, sampling options: generous


def body_limit(settings: GatewaySettings) -> tuple[int, str]:
    """(limit in bytes, why it is the limit, for the 413's message)."""
    images = settings.images
    image_bytes = (images.max_total_image_bytes * 4 + 2) // 3 if images.max_images else 0
    fits = settings.context_limit * MAX_TOKEN_BYTES * MAX_JSON_BYTES_PER_BYTE + image_bytes + STRUCTURE_BYTES
    if fits < settings.max_body_bytes:
        return fits, f" (no body larger can fit the context of {settings.context_limit} tokens)"
    return settings.max_body_bytes, ""
