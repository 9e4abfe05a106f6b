"""Fill the start-up cache (`derived_cache`) ahead of time, e.g. while building an image.

A container's first start would otherwise derive every table itself (~1-1.5 s per
process), and with a read-only root filesystem (deploy/k8s) it cannot keep them, so
every restart pays again. `deepinfer-gateway warm-cache` runs this at image build.
"""

from __future__ import annotations

from pathlib import Path

from deepinfer_gateway.recipe_bridge import derived_cache
from deepinfer_gateway.recipe_bridge.detokenizer import token_bytes
from deepinfer_gateway.recipe_bridge.encoder import PromptEncoder
from deepinfer_gateway.recipe_bridge.tokenizer import load_tokenizer


def warm_start_up_cache(tokenizer_path: str | None = None) -> list[Path]:
    """Derive what a gateway (encoder) and a sim worker (detokenizer) derive at start-up; the entries now cached."""
    bundle = load_tokenizer(tokenizer_path)
    PromptEncoder(bundle)
    token_bytes(bundle.json_text)
    return sorted(derived_cache.cache_dir().glob("*.marshal"))
