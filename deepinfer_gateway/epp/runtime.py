"""The EPP process: its composition root and its servers.

`EppRuntime` composes the routing core `serve`'s lifespan composes (gateway/routing_core.py,
from the same settings: the upstreams, Redis, the prefix index and its KV event feeder, the
in-flight store, the worker registry, the planner, admin sync and DNS discovery); then the
ext_proc server (extproc.py), the gRPC health services
(`liveness`; `readiness` and the ext_proc service's own once a unified worker is healthy)
and `/metrics`. Each listens on loopback unless told otherwise: a deploy file that wants
the pod's address says so (`--grpc-host 0.0.0.0`).
"""

from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass
from typing import Any

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import start_http_server

from deepinfer_gateway.config import GatewaySettings
from deepinfer_gateway.epp.extproc import EndpointPickerService
from deepinfer_gateway.epp.metrics import EppMetrics
from deepinfer_gateway.epp.picker import EndpointPicker
from deepinfer_gateway.gateway.routing_core import RoutingCore
from deepinfer_gateway.gateway.serving.flow_gate import FlowGate
from deepinfer_gateway.gateway.serving.route_inputs import RouteInputs
from deepinfer_gateway.recipe_bridge.encoder import PromptEncoder
from deepinfer_gateway.recipe_bridge.prepare import BridgeConfig, RequestPreparer
from deepinfer_gateway.recipe_bridge.prepared import ApiProtocol
from deepinfer_gateway.recipe_bridge.tokenizer import load_tokenizer

log = logging.getLogger(__name__)

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
READY_SERVICES = ("readiness", EXT_PROC_SERVICE)


@dataclass(frozen=True)
class EppOptions:
    """Where the EPP listens (port 0: any free port, read back from `EppRuntime`)."""

    grpc_host: str = "127.0.0.1"
    grpc_port: int = 9002
    health_port: int = 9003
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 9090
    fallbacks: int = 2  # endpoints listed after the pick, for the data plane's retries
    subset_hint_header: bool = False  # take the subset hint from the request header too (extproc.py)


class EppRuntime:
    def __init__(self, settings: GatewaySettings, options: EppOptions, metrics: EppMetrics | None = None):
        self.settings = settings
        self.options = options
        self.metrics = metrics or EppMetrics()
        self.metrics.gateway.expect_models([str(p) for p in ApiProtocol], settings.model_names)
        self.bundle = load_tokenizer(settings.tokenizer_path)
        self.preparer = RequestPreparer(
            PromptEncoder(self.bundle),
            BridgeConfig(model_names=settings.model_names, model_aliases=settings.model_aliases,
                         context_limit=settings.context_limit, images=settings.images))
        self.preparer.warm_up()
        self.health = health.aio.HealthServicer()
        self.ports: dict[str, int] = {}
        self._stack: list[Any] = []

    async def start(self) -> None:
        settings, metrics = self.settings, self.metrics.gateway
        self.core = core = RoutingCore(settings, self.bundle, metrics)
        await core.start()
        routing = RouteInputs(core.registry, core.planner, core.index, core.inflight, metrics, settings,
                              core.affinity)
        gate = (FlowGate(settings.flow_control, routing.views,
                         lambda hardware: core.planner.hardware_cost(hardware).prefill_tokens_per_s, metrics,
                         sends_priority=False, redis=core.redis)  # Envoy forwards the client's own body
                if settings.flow_control.enabled else None)
        self.picker = EndpointPicker(core.registry, routing, metrics, self.options.fallbacks, gate)
        service = EndpointPickerService(self.picker, self.preparer, self.metrics, settings,
                                        self.options.subset_hint_header)

        self.grpc = grpc.aio.server()
        pb_grpc.add_ExternalProcessorServicer_to_server(service, self.grpc)
        self.ports["grpc"] = self.grpc.add_insecure_port(f"{self.options.grpc_host}:{self.options.grpc_port}")
        self.health_server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.health_server)
        self.ports["health"] = self.health_server.add_insecure_port(
            f"{self.options.grpc_host}:{self.options.health_port}")
        await self.health.set("liveness", health_pb2.HealthCheckResponse.SERVING)
        await self._set_ready(self.picker.ready())
        await self.grpc.start()
        await self.health_server.start()
        http, _thread = start_http_server(self.options.metrics_port, self.options.metrics_host,
                                          registry=metrics.exposition)
        self.http = http
        self.ports["metrics"] = http.server_port
        self._ready_task = asyncio.get_running_loop().create_task(self._watch_ready())
        log.info("EPP: ext_proc on %s:%d, health on :%d, metrics on %s:%d", self.options.grpc_host,
                 self.ports["grpc"], self.ports["health"], self.options.metrics_host, self.ports["metrics"])

    async def _set_ready(self, ready: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in READY_SERVICES:
            await self.health.set(service, status)

    async def _watch_ready(self) -> None:
        """Readiness follows the registry: SERVING while a unified worker is healthy."""
        ready: bool | None = None
        while True:
            now = self.picker.ready()
            if now != ready:
                ready = now
                await self._set_ready(now)
            await asyncio.sleep(0.2)

    async def stop(self, grace_s: float = 5.0) -> None:
        self._ready_task.cancel()
        await self.health.enter_graceful_shutdown()
        await self.grpc.stop(grace_s)
        await self.health_server.stop(0)
        self.http.shutdown()
        if self.picker.gate is not None:
            await self.picker.gate.close()
        await self.core.stop()


async def serve_epp(settings: GatewaySettings, options: EppOptions) -> None:
    """Run until SIGTERM or SIGINT; requests in flight get `shutdown_grace_s` to end."""
    runtime = EppRuntime(settings, options)
    await runtime.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runtime.stop(settings.shutdown_grace_s)


def run_epp(settings: GatewaySettings, options: EppOptions) -> int:
    asyncio.run(serve_epp(settings, options))
    return 0
