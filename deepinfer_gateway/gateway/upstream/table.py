"""The adapter table: a worker's `Upstream` (base.py) built by its engine kind.

`ADAPTERS` maps `WorkerSpec.engine` to its adapter module's class; `Upstreams` owns the
pooled connections (http.HttpPool) and builds one adapter per worker for the
registry. A new engine kind is an adapter module, its `WorkerSpec` variant and its line here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import aiohttp

from deepinfer_gateway.config import WorkerEngine, WorkerSpec
from deepinfer_gateway.core.worker_auth import SecretTokens
from deepinfer_gateway.gateway.upstream.base import UNCOUNTED, MuxMetrics, Timeouts, Upstream
from deepinfer_gateway.gateway.upstream.dgw import DgwUpstream
from deepinfer_gateway.gateway.upstream.http import HttpPool
from deepinfer_gateway.gateway.upstream.openai import OpenAIUpstream
from deepinfer_gateway.gateway.upstream.vllm import VllmUpstream
from deepinfer_gateway.recipe_bridge.tokenizer import TokenizerBundle

# Each takes its engine's `WorkerSpec` variant: the union's `engine` tag is the table's key.
Adapter = Callable[[Any, HttpPool, TokenizerBundle], Upstream]

ADAPTERS: dict[WorkerEngine, Adapter] = {
    WorkerEngine.DGW: lambda spec, http, _bundle: DgwUpstream(spec, http),
    WorkerEngine.VLLM: lambda spec, http, _bundle: VllmUpstream(spec, http),
    WorkerEngine.OPENAI: OpenAIUpstream,  # re-tokenizes the server's text with the gateway's tokenizer
}


class Upstreams(HttpPool):
    """The connection pool, and each worker's adapter built on it."""

    def __init__(self, tokenizer: TokenizerBundle, timeouts: Timeouts = Timeouts(),
                 session: aiohttp.ClientSession | None = None, tokens: SecretTokens | None = None,
                 mux: bool = True, mux_metrics: MuxMetrics = UNCOUNTED):
        super().__init__(timeouts, session, tokens, mux, mux_metrics)
        self._tokenizer = tokenizer

    def upstream(self, spec: WorkerSpec) -> Upstream:
        return ADAPTERS[spec.engine](spec, self, self._tokenizer)
