"""A simulated cluster in one process: N sim workers on N ports sharing one KV store.

The demo and the HTTP tests run every sim worker in the caller's event loop, each
behind its own uvicorn server on its own port, so they look to the gateway exactly like
separate worker processes, while sharing one in-process SimKvStore (the "3FS" tier) and
one tokenizer/output planner.

    cluster = await serve_sim_cluster([SimWorkerSpec("p0", Role.PREFILL), ...])
    cluster.urls  # {"p0": "http://127.0.0.1:41234", ...}
    await cluster.stop()
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from deepinfer_gateway.core.protocol import DEFAULT_MODEL, Role
from deepinfer_gateway.core.worker_auth import SecretTokens
from deepinfer_gateway.infra.asgi import ServedApp, serve_app
from deepinfer_gateway.recipe_bridge.tokenizer import load_tokenizer
from deepinfer_gateway.workers.server import create_worker_app
from deepinfer_gateway.workers.sim.compat import compat_router
from deepinfer_gateway.workers.sim.engine import Failures, SimEngine
from deepinfer_gateway.workers.sim.kv_store import InMemoryKvStore, SimKvStore
from deepinfer_gateway.workers.sim.output import OutputPlanner
from deepinfer_gateway.workers.sim.profiles import load_profiles


@dataclass(frozen=True)
class SimWorkerSpec:
    worker_id: str
    role: Role = Role.UNIFIED
    hardware: str = "sm100"  # a profile name from the profiles TOML
    port: int = 0  # 0: any free port
    time_scale: float = 1.0
    memory_capacity_blocks: int | None = None  # override the profile's
    failures: Failures = Failures()


@dataclass
class InProcessSimCluster:
    engines: dict[str, SimEngine]
    served: dict[str, ServedApp]
    store: SimKvStore | None
    specs: list[SimWorkerSpec] = field(default_factory=list)

    @property
    def urls(self) -> dict[str, str]:
        return {wid: app.url for wid, app in self.served.items()}

    @property
    def ports(self) -> dict[str, int]:
        return {wid: app.port for wid, app in self.served.items()}

    async def stop(self) -> None:
        await asyncio.gather(*(app.stop() for app in self.served.values()))


def build_sim_engine(
    spec: SimWorkerSpec,
    *,
    store: SimKvStore | None,
    planner: OutputPlanner,
    profiles_path: str | None = None,
    model: str = DEFAULT_MODEL,
) -> SimEngine:
    profile = load_profiles(profiles_path)[spec.hardware]
    if spec.memory_capacity_blocks is not None:
        profile = replace(profile, memory_capacity_blocks=spec.memory_capacity_blocks)
    return SimEngine(
        worker_id=spec.worker_id,
        profile=profile,
        role=spec.role,
        model=model,
        store=store,
        time_scale=spec.time_scale,
        planner=planner,
        failures=spec.failures,
    )


async def serve_sim_cluster(
    specs: list[SimWorkerSpec],
    host: str = "127.0.0.1",
    *,
    with_store: bool = True,
    store: SimKvStore | None = None,
    profiles_path: str | None = None,
    model: str = DEFAULT_MODEL,
    tokenizer_path: str | None = None,
    compat: bool = True,
    wrap: Callable[[Any], Any] = lambda app: app,
    tokens: SecretTokens | None = None,
) -> InProcessSimCluster:
    """Start every worker of `specs`; `with_store=False` makes a memory-only cluster. `wrap`:
    ASGI middleware around each worker's app (e.g. tracing). `tokens`: the worker token
    every call but /health must present (worker_auth.py)."""
    if len({s.worker_id for s in specs}) != len(specs):
        raise ValueError("worker ids must be unique")
    bundle = load_tokenizer(tokenizer_path)
    planner = OutputPlanner(bundle)
    shared = (store or InMemoryKvStore()) if with_store else None
    engines = {s.worker_id: build_sim_engine(s, store=shared, planner=planner, profiles_path=profiles_path, model=model)
               for s in specs}
    served: dict[str, ServedApp] = {}
    try:
        for spec in specs:
            engine = engines[spec.worker_id]
            routers = [compat_router(engine, bundle, model)] if compat else []
            served[spec.worker_id] = await serve_app(wrap(create_worker_app(engine, routers, tokens)), host, spec.port)
    except BaseException:
        await asyncio.gather(*(app.stop() for app in served.values()))
        raise
    return InProcessSimCluster(engines, served, shared, list(specs))

