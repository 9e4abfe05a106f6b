"""Placeholder: filled in below."""

from __future__ import annotations

from fastapi import APIRouter

from deepinfer_gateway.recipe_bridge.tokenizer import TokenizerBundle
from deepinfer_gateway.workers.sim.engine import SimEngine


def compat_router(engine: SimEngine, bundle: TokenizerBundle, model: str) -> APIRouter:
    return APIRouter()
