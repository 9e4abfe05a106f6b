"""Prometheus metrics of one gateway process, in a registry it owns.

Names are a contract (docs/architecture: Grafana dashboard, benchmarks): prefix `dgw_`,
counters end in `_total`, durations in `_seconds`, labels bounded (protocol, model from
the configured list, status code, pool, hardware, reason enum, worker id from config).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0, 2.0)
DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
LOOKUP_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1)


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter("dgw_requests", "Client requests by outcome", ["protocol", "model", "status"], registry=r)
        self.ttft = Histogram("dgw_time_to_first_token_seconds", "Request arrival to first token sent",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("dgw_inter_token_latency_seconds", "Gap between streamed token messages",
                             buckets=ITL_BUCKETS, registry=r)
        self.duration = Histogram("dgw_request_duration_seconds", "Request arrival to last byte",
                                  buckets=DURATION_BUCKETS, registry=r)
        self.prompt_tokens = Counter("dgw_prompt_tokens", "Prompt tokens of served requests", registry=r)
        self.cached_tokens = Counter("dgw_cached_prompt_tokens", "Prompt tokens the worker reported cached",
                                     ["tier"], registry=r)
        self.predicted_cached_tokens = Counter("dgw_predicted_cached_tokens",
                                               "Cached tokens the prefix index predicted on the chosen worker",
                                               ["tier"], registry=r)
        self.generation_tokens = Counter("dgw_generation_tokens", "Output tokens relayed", registry=r)
        self.routing_decisions = Counter("dgw_routing_decisions", "Routing decisions",
                                         ["pool", "hardware", "reason"], registry=r)
        self.worker_healthy = Gauge("dgw_worker_healthy", "1 if the worker passes health checks", ["worker"],
                                    registry=r)
        self.worker_queue_tokens = Gauge("dgw_worker_queue_tokens", "Queued prefill tokens (load report)",
                                         ["worker"], registry=r)
        self.worker_running = Gauge("dgw_worker_running_requests", "Running sequences (load report)", ["worker"],
                                    registry=r)
        self.worker_kv_usage = Gauge("dgw_worker_kv_usage_ratio", "KV memory in use (load report)", ["worker"],
                                     registry=r)
        self.prefix_lookup = Histogram("dgw_prefix_index_lookup_seconds", "Prefix index lookup latency",
                                       buckets=LOOKUP_BUCKETS, registry=r)
        self.upstream_errors = Counter("dgw_upstream_errors", "Failed worker calls", ["worker", "kind"], registry=r)
        self.retries = Counter("dgw_retries", "Requests retried on another worker before the first token",
                               ["reason"], registry=r)
        self.client_disconnects = Counter("dgw_client_disconnects", "Clients gone before the end of their stream",
                                          registry=r)
        self.inflight = Gauge("dgw_inflight_requests", "Requests in flight in this gateway process", registry=r)
        self.prediction_error = Histogram(
            "dgw_cache_prediction_error_ratio",
            "(predicted - reported cached tokens) / prompt tokens, per routed request: >0 the index over-predicts",
            buckets=(-1.0, -0.5, -0.25, -0.1, -0.05, -0.01, 0.0, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0), registry=r)
        self.admission_rejections = Counter("dgw_admission_rejections", "Requests refused (429) by admission control",
                                            ["pool"], registry=r)
        self.redis_errors = Counter("dgw_redis_errors", "Failed Redis operations (the gateway degrades, not fails)",
                                    ["component"], registry=r)
        self.preprocess = Histogram("dgw_preprocess_seconds", "Convert + encode + hash time per request",
                                    buckets=LOOKUP_BUCKETS + (0.25, 0.5), registry=r)
