"""Single-worker entry point: `deepinfer-gateway worker --engine sim ...` calls `run_worker`.

Blocks until SIGINT/SIGTERM (uvicorn's own handling), then stops the engine (in-flight
requests get a `shutting_down` finish). A lone sim worker has no shared KV store unless
`with_store` is set, in which case it keeps a private in-process one (a separate process
cannot share another's memory); prefill hand-offs are then `direct:` handles.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from deepinfer_gateway.core.protocol import DEFAULT_MODEL, Role
from deepinfer_gateway.core.worker_auth import SecretTokens, check_bind
from deepinfer_gateway.infra.asgi import run_until_signal
from deepinfer_gateway.recipe_bridge.tokenizer import load_tokenizer
from deepinfer_gateway.workers.server import create_worker_app
from deepinfer_gateway.workers.sim.cluster import SimWorkerSpec, build_sim_engine
from deepinfer_gateway.workers.sim.compat import compat_router
from deepinfer_gateway.workers.sim.kv_store import InMemoryKvStore
from deepinfer_gateway.workers.sim.output import OutputPlanner


@dataclass(frozen=True)
class WorkerOptions:
    engine: str = "sim"  # "sim" | "deepinfer"
    role: Role = Role.UNIFIED
    hardware: str = "sm100"
    host: str = "127.0.0.1"
    port: int = 8100
    worker_id: str | None = None  # default: "<hardware>-<role>-<port>"
    profiles_path: str | None = None
    time_scale: float = 1.0
    model: str = DEFAULT_MODEL
    tokenizer_path: str | None = None
    with_store: bool = False
    compat: bool = True  # OpenAI/SGLang-compatible endpoints for third-party routers
    tokens: SecretTokens | None = None  # the worker token callers must present (worker_auth.py)


def run_worker(options: WorkerOptions, wrap: Callable[[Any], Any] = lambda app: app) -> None:
    """Build the sim worker's app, `wrap` it (ASGI middleware, e.g. tracing), serve it."""
    check_bind(options.host, options.tokens)
    if options.engine != "sim":
        raise ValueError(f"engine {options.engine!r} is served by deepinfer_gateway.workers.deepinfer, not run_worker")
    worker_id = options.worker_id or f"{options.hardware}-{options.role}-{options.port}"
    spec = SimWorkerSpec(worker_id, options.role, options.hardware, options.port, options.time_scale)
    bundle = load_tokenizer(options.tokenizer_path)
    store = InMemoryKvStore() if options.with_store else None
    engine = build_sim_engine(
        spec, store=store, planner=OutputPlanner(bundle), profiles_path=options.profiles_path, model=options.model
    )
    routers = [compat_router(engine, bundle, options.model)] if options.compat else []
    app = wrap(create_worker_app(engine, routers, options.tokens))
    run_until_signal(app, options.host, options.port, log_level="warning", graceful_s=2)
