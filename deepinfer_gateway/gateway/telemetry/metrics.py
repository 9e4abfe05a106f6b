"""Prometheus metrics of one gateway process, in a registry it owns.

Names are a contract (docs/metrics.md, generated from this registry by
`python -m deepinfer_gateway.gateway.telemetry.metrics_reference`; the Grafana dashboard, the alert
rules and the benchmarks read them): prefix `dgw_`, counters end in `_total`, durations
in `_seconds`, labels bounded (protocol, model from the configured list, status code,
pool, hardware, reason enum, worker id from config).

Per-request histograms are labelled `model, pool, hardware`; the request path looks their
children up once per worker leg (`request_series`), never per streamed chunk.

With PROMETHEUS_MULTIPROC_DIR set, every process of a host writes to that folder and
`/metrics` serves their merge (metrics_host.py); each gauge states its `multiprocess_mode`.

A labelled counter's series exists at 0 from the moment its label values are known (served
models, pools and workers as they are configured or join, enums at start): `rate()` and
`increase()` see a series' first increment only if an earlier scrape saw it at 0.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import subprocess
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

from deepinfer_gateway.core.errors import UpstreamKind
from deepinfer_gateway.core.protocol import V1Fallback
from deepinfer_gateway.gateway.telemetry.loop_lag import LAG_BUCKETS
from deepinfer_gateway.gateway.telemetry.metrics_host import (
    HostCollector,
    ProcessCpuCollector,
    live_processes,
    multiprocess_dir,
)

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0, 2.0)
DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
QUEUE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
LOOKUP_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1)
# Prompt lengths up to the 128k context, output lengths up to 32k.
PROMPT_TOKEN_BUCKETS = (16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 98304, 131072)
OUTPUT_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)

REQUEST_LABELS = ("model", "pool", "hardware")
WORKER_LABEL = "worker"
CACHE_TIERS = ("memory", "store")
# dgw_responses_not_stored_total reasons (serving/responses_api.py)
NOT_STORED_REASONS = ("unavailable", "full", "refused")
# dgw_requests_total{status} values that exist at 0 for every generation protocol and served
# model: what the gateway answers itself (errors.GatewayError subclasses, 200, 499) and the
# usual statuses relayed from a worker. Others appear at their first request.
ANSWERED_STATUSES = ("200", "400", "401", "403", "404", "413", "422", "429", "499", "500", "502", "503", "504")
UNKNOWN_MODEL = "unknown"


@dataclass(frozen=True, slots=True)
class RequestSeries:
    """The per-request histograms' children of one (model, pool, hardware)."""

    model: str
    pool: str
    hardware: str
    ttft: Histogram
    itl: Histogram
    duration: Histogram
    queue: Histogram
    prompt_len: Histogram
    output_len: Histogram


class GatewayMetrics:
    """Every metric of one gateway process, registered in `registry` (the reference for the
    docs). `exposition` is what `/metrics` serves: `registry` itself, or with
    PROMETHEUS_MULTIPROC_DIR set, the merge of every process on the host (metrics_host.py),
    where each gauge's `multiprocess_mode` says how its processes' values combine.
    Multiprocess mode holds one GatewayMetrics per process: two would write the same series."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry

        def per_request(name: str, documentation: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, documentation, REQUEST_LABELS, buckets=buckets, registry=r)

        def worker_gauge(name: str, documentation: str) -> Gauge:
            # Every process reads the same worker on its own health checks: the newest
            # reading is the host's best (a sum would count it once per process, a min or
            # max would hold on to a stale value of a process that no longer updates it).
            return Gauge(name, documentation, [WORKER_LABEL], multiprocess_mode="livemostrecent", registry=r)

        self.build = Info("dgw_build", "Build of this gateway process (value 1): version, python, git_sha",
                          registry=r)
        self.build.info(build_labels())
        self.requests = Counter("dgw_requests", "Client requests by outcome", ["protocol", "model", "status"],
                                registry=r)
        self.ttft = per_request("dgw_time_to_first_token_seconds",
                                "Request arrival to its first token sent (labels: the worker that produced it)",
                                TTFT_BUCKETS)
        self.itl = per_request("dgw_inter_token_latency_seconds",
                               "Gap between streamed token messages (labels: the worker that sent the later one)",
                               ITL_BUCKETS)
        self.duration = per_request("dgw_request_duration_seconds",
                                    "Request arrival to last byte, requests that got a first token "
                                    "(labels: the worker of the last leg)", DURATION_BUCKETS)
        self.queue_time = per_request("dgw_queue_time_seconds",
                                      "Request arrival to the serving worker's `ready` event (the engine scheduled "
                                      "it): preprocessing, routing, retries and the engine's queue; excludes prefill",
                                      QUEUE_BUCKETS)
        self.request_prompt_tokens = per_request("dgw_request_prompt_tokens",
                                                 "Prompt tokens per request, as the first worker counted them",
                                                 PROMPT_TOKEN_BUCKETS)
        self.request_generation_tokens = per_request("dgw_request_generation_tokens",
                                                     "Output tokens per request that got a first token, however it "
                                                     "ended (labels: the worker of the last leg)", OUTPUT_TOKEN_BUCKETS)
        self.prompt_tokens = Counter("dgw_prompt_tokens", "Prompt tokens of served requests", registry=r)
        self.cached_tokens = Counter("dgw_cached_prompt_tokens", "Prompt tokens the worker reported cached",
                                     ["tier"], registry=r)
        self.predicted_cached_tokens = Counter("dgw_predicted_cached_tokens",
                                               "Cached tokens the prefix index predicted on the chosen worker",
                                               ["tier"], registry=r)
        self.generation_tokens = Counter("dgw_generation_tokens", "Output tokens relayed", registry=r)
        self.routing_decisions = Counter("dgw_routing_decisions", "Routing decisions",
                                         ["pool", "hardware", "reason"], registry=r)
        self.worker_healthy = worker_gauge("dgw_worker_healthy", "1 if the worker passes health checks")
        self.worker_queue_tokens = worker_gauge("dgw_worker_queue_tokens", "Queued prefill tokens (load report)")
        self.worker_running = worker_gauge("dgw_worker_running_requests", "Running sequences (load report)")
        self.worker_kv_usage = worker_gauge("dgw_worker_kv_usage_ratio", "KV memory in use (load report)")
        self.worker_preemptions = worker_gauge("dgw_worker_preemptions", "Running requests the engine preempted "
                                               "for a more urgent one since it started (load report; a worker "
                                               "that schedules by priority)")
        self.prefix_lookup = Histogram("dgw_prefix_index_lookup_seconds", "Prefix index lookup latency",
                                       buckets=LOOKUP_BUCKETS, registry=r)
        self.upstream_errors = Counter("dgw_upstream_errors", "Failed worker calls", [WORKER_LABEL, "kind"],
                                       registry=r)
        self.retries = Counter("dgw_retries", "Requests retried on another worker before the first token",
                               ["reason"], registry=r)
        self.client_disconnects = Counter("dgw_client_disconnects", "Clients gone before the end of their stream",
                                          registry=r)
        self.inflight = Gauge("dgw_inflight_requests", "Requests in flight in this gateway process "
                              "(several processes on a host: their sum)", multiprocess_mode="livesum", registry=r)
        self.prediction_error = Histogram(
            "dgw_cache_prediction_error_ratio",
            "(predicted - reported cached tokens) / prompt tokens, per routed request: >0 the index over-predicts",
            buckets=(-1.0, -0.5, -0.25, -0.1, -0.05, -0.01, 0.0, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0), registry=r)
        self.loop_lag = Histogram("dgw_event_loop_lag_seconds",
                                  "How late a 100 ms timer ran on this process's event loop (CPU starvation, "
                                  "long synchronous steps)", buckets=LAG_BUCKETS, registry=r)
        self.stall_timeouts = Counter("dgw_stall_timeouts", "Worker calls timed out while this process's event "
                                      "loop was held up: not counted against the worker's health", registry=r)
        self.admission_rejections = Counter("dgw_admission_rejections", "Requests refused (429) by admission control",
                                            ["pool"], registry=r)
        self.flow_queued = Gauge("dgw_flow_queued_requests", "Requests waiting in flow control (several processes "
                                 "on a host: their sum)", ["pool", "service_tier"], multiprocess_mode="livesum",
                                 registry=r)
        self.flow_wait = Histogram("dgw_flow_wait_seconds", "Time a request waited in flow control before it was "
                                   "placed (0: its pool was not saturated)", ["pool", "service_tier"],
                                   buckets=QUEUE_BUCKETS, registry=r)
        self.flow_shed = Counter("dgw_flow_shed", "Requests flow control refused (429 before any token)",
                                 ["pool", "service_tier", "reason"], registry=r)
        self.flow_ttft = Counter("dgw_flow_ttft", "Requests under flow control that got a first token, by whether "
                                 "it came within their TTFT target (met: goodput)", ["service_tier", "met"],
                                 registry=r)
        self.flow_starved = Counter("dgw_flow_starved", "Requests refused at their deadline as their tenant's next "
                                    "in their tier, while requests of other tenants of that tier that arrived after "
                                    "them started: the tenant got no turn (a fair share too small for the "
                                    "deadline, or a bug)", ["pool", "service_tier"], registry=r)
        self.flow_routers = Gauge("dgw_flow_share_routers", "Other routers whose fresh reports this one's last "
                                  "fair-share exchange heard (flow_control.shared_share)", ["pool"],
                                  multiprocess_mode="livemostrecent", registry=r)
        self.session_waits = Counter("dgw_session_waits", "Session rounds that waited for room in their worker's KV "
                                     "cache (session_capacity)", ["pool"], registry=r)
        self.session_wait = Histogram("dgw_session_wait_seconds", "Time a session round waited for room in its "
                                      "worker's KV cache (rounds that waited)", ["pool"], buckets=QUEUE_BUCKETS,
                                      registry=r)
        self.session_proceeded = Counter("dgw_session_proceeded", "Session rounds that waited session_capacity."
                                         "max_wait_ms without room and went anyway", ["pool"], registry=r)
        self.session_live = Gauge("dgw_session_live_sessions", "Sessions live on the worker: a round in flight or "
                                  "ended less than session_capacity.ttl_ms ago (several processes on a host: their "
                                  "sum)", [WORKER_LABEL], multiprocess_mode="livesum", registry=r)
        self.session_rounds = Counter("dgw_session_rounds", "Rounds of named sessions, by whether their prompt "
                                      "starts with the session's previous prompt in this process (to its last "
                                      "full KV block): extends, breaks (compaction, an edited history: prefilled "
                                      "again whatever the routing), unseen (its first, or another replica's)",
                                      ["prefix"], registry=r)
        self.redis_errors = Counter("dgw_redis_errors", "Failed Redis operations (the gateway degrades, not fails)",
                                    ["component"], registry=r)
        self.responses_not_stored = Counter(
            "dgw_responses_not_stored", "Responses asked to be stored (store: true) but served unstored, by reason",
            ["reason"], registry=r)
        self.conversation_appends_failed = Counter(
            "dgw_conversation_appends_failed", "Responses answered whose input and output could not be appended to "
            "their conversation (deleted meanwhile, full, or the store failing)", registry=r)
        self.background_responses = Counter(
            "dgw_background_responses", "Background responses (background: true) ended, by their final status",
            ["outcome"], registry=r)
        self.preprocess = Histogram("dgw_preprocess_seconds", "Convert + encode + hash time per request",
                                    buckets=LOOKUP_BUCKETS + (0.25, 0.5), registry=r)
        self.v2_connections = Gauge("dgw_worker_v2_connections",
                                    "Open worker protocol v2 connections to the worker (several processes on a "
                                    "host: their sum; 2 while one retires after a token rotation)",
                                    [WORKER_LABEL], multiprocess_mode="livesum", registry=r)
        self.v2_reconnects = Counter("dgw_worker_v2_reconnects", "v2 connections opened after the last one to the "
                                     "worker closed (it restarted, the network broke, pings went unanswered)",
                                     [WORKER_LABEL], registry=r)
        self.v2_coalesced = Counter("dgw_worker_v2_coalesced_events",
                                    "v2 `tokens` events merged into the last queued one of a stream whose client "
                                    "reads slower than the worker writes (backpressure: nothing is dropped)",
                                    [WORKER_LABEL], registry=r)
        self.v1_fallbacks = Counter("dgw_worker_v1_fallbacks", "Legs sent over worker protocol v1 with "
                                    "worker_protocol = auto, by reason", [WORKER_LABEL, "reason"], registry=r)
        self.pool_healthy = Gauge("dgw_pool_healthy_workers",
                                  "Workers of the pool that pass health checks, from the moment the pool has a worker "
                                  "(0 once all are gone: the pool serves nothing)",
                                  ["pool"], multiprocess_mode="livemostrecent", registry=r)
        for tier in CACHE_TIERS:
            self.cached_tokens.labels(tier)
            self.predicted_cached_tokens.labels(tier)
        for kind in UpstreamKind:
            self.retries.labels(kind)
        for reason in NOT_STORED_REASONS:
            self.responses_not_stored.labels(reason)
        # Every metric labelled by worker: a removed worker's series go with it.
        self.per_worker = (self.worker_healthy, self.worker_queue_tokens, self.worker_running, self.worker_kv_usage,
                           self.worker_preemptions,
                           self.upstream_errors, self.v2_connections, self.v2_reconnects, self.v2_coalesced,
                           self.v1_fallbacks, self.session_live)
        self._series: dict[tuple[str, str, str], RequestSeries] = {}
        # v2 connections outlive their worker's registration (streams finish on them): they are
        # counted here, and their series exist only while the worker is registered, so a removed
        # worker's connection closing later does not bring its series back.
        self._registered: set[str] = set()
        self._v2_open: dict[str, int] = {}
        shared_dir = multiprocess_dir()
        self.process_cpu = ProcessCpuCollector(functools.partial(live_processes, shared_dir) if shared_dir
                                               else lambda: (os.getpid(),))
        r.register(self.process_cpu)
        self.exposition = r
        if shared_dir:
            self.exposition = CollectorRegistry(auto_describe=False)
            self.exposition.register(HostCollector(shared_dir, (self.build, self.process_cpu), WORKER_LABEL,
                                                   self.workers_here))

    def count_request(self, protocol: str, model: str, status: int | str) -> None:
        """dgw_requests_total: every request's outcome is recorded here, once.
        `protocol`: an ApiProtocol or a non-generation route; `model`: a served name or `unknown`."""
        self.requests.labels(protocol, model, str(status)).inc()

    def expect_models(self, protocols: Iterable[str], models: Iterable[str]) -> None:
        """dgw_requests_total at 0 for every generation protocol, served model (and `unknown`)
        and answered status, so the first 5xx or 429 of a model is an increase from 0."""
        for protocol in protocols:
            for model in (*models, UNKNOWN_MODEL):
                for status in ANSWERED_STATUSES:
                    self.requests.labels(protocol, model, status)

    def admit_worker(self, worker_id: str, pool: str) -> None:
        """A worker joined the registry (configuration, admin API or discovery): its error
        counters and its pool's start at 0."""
        for kind in UpstreamKind:
            self.upstream_errors.labels(worker_id, kind)
        self.admission_rejections.labels(pool)
        self.session_waits.labels(pool)
        self.session_proceeded.labels(pool)
        self._registered.add(worker_id)
        self.v2_connections.labels(worker_id).set(self._v2_open.get(worker_id, 0))
        self.v2_reconnects.labels(worker_id)
        self.v2_coalesced.labels(worker_id)
        for reason in V1Fallback:
            self.v1_fallbacks.labels(worker_id, reason)

    # -- upstream.base.MuxMetrics: the v2 connections ----------------------------------

    def mux_opened(self, worker: str, reconnect: bool) -> None:
        self._v2_open[worker] = open_now = self._v2_open.get(worker, 0) + 1
        if worker in self._registered:
            self.v2_connections.labels(worker).set(open_now)
            if reconnect:
                self.v2_reconnects.labels(worker).inc()

    def mux_closed(self, worker: str) -> None:
        open_now = self._v2_open.pop(worker, 1) - 1
        if open_now > 0:
            self._v2_open[worker] = open_now
        if worker in self._registered:
            self.v2_connections.labels(worker).set(open_now)

    def mux_coalesced(self, worker: str) -> None:
        if worker in self._registered:
            self.v2_coalesced.labels(worker).inc()

    def mux_fallback(self, worker: str, reason: V1Fallback) -> None:
        if worker in self._registered:
            self.v1_fallbacks.labels(worker, reason).inc()

    def request_series(self, model: str, pool: str, hardware: str) -> RequestSeries:
        """The children for a served model name, a configured pool and a Hardware value:
        bounded keys, so the cache is too."""
        key = (model, pool, hardware)
        series = self._series.get(key)
        if series is None:
            series = self._series[key] = RequestSeries(
                *key, self.ttft.labels(*key), self.itl.labels(*key), self.duration.labels(*key),
                self.queue_time.labels(*key), self.request_prompt_tokens.labels(*key),
                self.request_generation_tokens.labels(*key))
        return series

    def forget_worker(self, worker_id: str) -> None:
        """Drop every series of a worker (it left the registry); a later one with the same
        id starts afresh. In multiprocess mode its values stay in the files (prometheus-client
        cannot delete them, and warns so): `workers_here` hides them from the merge."""
        self._registered.discard(worker_id)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Removal of labels has not been implemented", UserWarning)
            for metric in self.per_worker:
                metric.remove_by_labels({WORKER_LABEL: worker_id})

    def workers_here(self) -> set[str]:
        """The workers this process holds series for (its registered ones, once checked)."""
        return {s.labels[WORKER_LABEL] for m in self.per_worker for f in m.collect() for s in f.samples}


@functools.cache
def build_labels() -> dict[str, str]:
    """`dgw_build_info`'s labels: one value each per process."""
    version = "unknown"
    git_sha = ""
    try:
        dist = metadata.distribution("deepinfer-gateway")
        version = dist.version
        direct_url = dist.read_text("direct_url.json")  # PEP 610: set by `pip install git+...`
        if direct_url:
            git_sha = json.loads(direct_url).get("vcs_info", {}).get("commit_id", "")
    except (metadata.PackageNotFoundError, ValueError):
        pass
    return {"version": version, "python": platform.python_version(),
            "git_sha": (git_sha or _checkout_sha() or "unknown")[:12]}


def _checkout_sha() -> str:
    """HEAD of the source checkout the package runs from (a development install), else ""."""
    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():
        return ""
    try:
        done = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=5, check=False)
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""
