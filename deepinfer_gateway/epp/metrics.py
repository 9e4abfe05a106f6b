"""The EPP's metrics: the gateway's `GatewayMetrics` (the dgw_* routing series it shares with
`serve`: decisions and reasons, index lookups, predicted vs reported cached tokens, requests by
outcome, in flight) plus its own processing time per ext_proc phase, in the same registry."""

from __future__ import annotations

from prometheus_client import Histogram

from deepinfer_gateway.gateway.telemetry.metrics import GatewayMetrics

PHASES = ("request_headers", "request_body", "request_trailers", "response_headers", "response_body",
          "response_trailers")
PHASE_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class EppMetrics:
    def __init__(self, gateway: GatewayMetrics | None = None):
        self.gateway = gateway or GatewayMetrics()
        self.phase = Histogram("dgw_epp_phase_seconds",
                               "EPP processing time of one ext_proc message, by phase (request_body: the "
                               "whole body's parse, tokenization and pick, at its last chunk)",
                               ["phase"], buckets=PHASE_BUCKETS, registry=self.gateway.registry)
        self.phases = {name: self.phase.labels(name) for name in PHASES}
