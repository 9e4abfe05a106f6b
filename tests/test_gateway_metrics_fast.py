"""GatewayMetrics' hot-path helpers record exactly what the plain prometheus calls would."""

from __future__ import annotations

import random

from prometheus_client import generate_latest

from deepinfer_gateway.gateway.metrics import GatewayMetrics


def _series(m: GatewayMetrics, name: str) -> list[str]:
    return [line for line in generate_latest(m.registry).decode().splitlines()
            if line.startswith(name) and "_created" not in line]


def test_observe_itl_matches_histogram_observe() -> None:
    plain, fast = GatewayMetrics(), GatewayMetrics()
    rng = random.Random(7)
    values = [0.0, 0.001, 0.0010001, 0.02, 2.0, 2.5, float("inf")] + [rng.expovariate(30) for _ in range(5000)]
    for v in values:
        plain.itl.observe(v)
        fast.observe_itl(v)
    assert _series(plain, "dgw_inter_token_latency_seconds") == _series(fast, "dgw_inter_token_latency_seconds")


def test_child_is_the_labelled_series() -> None:
    m = GatewayMetrics()
    child = m.child(m.requests, "chat", "model-a", "200")
    assert child is m.child(m.requests, "chat", "model-a", "200") is m.requests.labels("chat", "model-a", "200")
    assert m.child(m.routing_decisions, "p", "h", "r") is not m.child(m.requests, "p", "h", "r")
    child.inc()
    m.requests.labels("chat", "model-a", "200").inc()
    assert 'dgw_requests_total{model="model-a",protocol="chat",status="200"} 2.0' in _series(m, "dgw_requests_total")
