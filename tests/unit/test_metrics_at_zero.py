"""Labelled counters whose label values are known exist at 0 before their first event, so
Prometheus' rate()/increase() see that event (a series born at 1 shows no increase)."""

from __future__ import annotations

import inspect

from deepinfer_gateway.core import errors
from deepinfer_gateway.core.errors import UpstreamKind
from deepinfer_gateway.gateway.telemetry.metrics import ANSWERED_STATUSES, CACHE_TIERS, UNKNOWN_MODEL, GatewayMetrics
from deepinfer_gateway.kvcache.types import INDEX_OPS, KvIndexMetrics
from deepinfer_gateway.recipe_bridge.prepared import ApiProtocol


def value(metrics: GatewayMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


def test_enum_labelled_counters_start_at_zero() -> None:
    metrics = GatewayMetrics()
    KvIndexMetrics(metrics.registry)
    for kind in UpstreamKind:
        assert value(metrics, "dgw_retries_total", reason=str(kind)) == 0
    for tier in CACHE_TIERS:
        assert value(metrics, "dgw_cached_prompt_tokens_total", tier=tier) == 0
        assert value(metrics, "dgw_predicted_cached_tokens_total", tier=tier) == 0
    for op in INDEX_OPS:
        assert value(metrics, "dgw_kv_index_errors_total", op=op) == 0


def test_requests_exist_at_zero_for_every_protocol_model_and_answered_status() -> None:
    metrics = GatewayMetrics()
    assert value(metrics, "dgw_requests_total", protocol="chat", model="m", status="503") is None
    metrics.expect_models([str(p) for p in ApiProtocol], ["m", "n"])
    for protocol in ApiProtocol:
        for model in ("m", "n", UNKNOWN_MODEL):
            for status in ANSWERED_STATUSES:
                assert value(metrics, "dgw_requests_total", protocol=str(protocol), model=model, status=status) == 0
    metrics.count_request("chat", "m", 503)
    assert value(metrics, "dgw_requests_total", protocol="chat", model="m", status="503") == 1


def test_every_status_the_gateway_answers_itself_is_expected() -> None:
    own = {cls.status_code for _, cls in inspect.getmembers(errors, inspect.isclass)
           if issubclass(cls, errors.GatewayError)}
    assert own >= {401, 429, 499, 502, 503}  # the walk found the error classes
    assert {str(s) for s in own} | {"200"} <= set(ANSWERED_STATUSES)
