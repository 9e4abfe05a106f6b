"""Gateway configuration: one frozen, validated pydantic object, passed in (never a global).

Loaded from TOML (`serve --config FILE`); environment variables `DGW_<FIELD>` override
top-level scalar fields (e.g. `DGW_PORT=9000`, `DGW_REDIS_URL=redis://...`).
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from deepinfer_gateway.model_catalog import BUILTIN_ALIASES, ModelAliases
from deepinfer_gateway.protocol import Hardware, Role


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


WorkloadClass = Literal["chat", "agent"]


class ApiKey(_Frozen):
    """An API key record; the key itself is stored only as its SHA-256 hex digest."""

    name: str
    key_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    models: tuple[str, ...] = ()  # empty: every served model
    workload_class: WorkloadClass = "chat"  # selects the KV store TTL class
    requests_per_minute: int | None = Field(None, ge=1)
    tokens_per_minute: int | None = Field(None, ge=1)
    admin: bool = False

    def allows(self, model: str) -> bool:
        return not self.models or model in self.models


class WorkerSpec(_Frozen):
    url: str
    role: Role = Role.UNIFIED
    hardware: Hardware = Hardware.SM100
    kv_format: str = ""  # "" = learn from the worker's info endpoint
    pool: str = ""  # "" = the role's default pool
    id: str = ""  # "" = derived from the URL

    @field_validator("url")
    @classmethod
    def _strip_slash(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")):
            raise ValueError("worker url must start with http:// or https://")
        return v.rstrip("/")

    @property
    def worker_id(self) -> str:
        return self.id or self.url.split("://", 1)[1]


class HealthSettings(_Frozen):
    interval_s: float = Field(1.0, gt=0)
    failures_to_eject: int = Field(2, ge=1)
    successes_to_readmit: int = Field(1, ge=1)


class HardwareCost(_Frozen):
    """What the router assumes of one engine instance of a hardware kind (cost model inputs)."""

    prefill_tokens_per_s: float = Field(gt=0)  # whole instance, at a typical batch
    kv_load_bytes_per_s: float = Field(gt=0)  # shared-store read bandwidth of one instance
    kv_bytes_per_token: float = Field(890.0, gt=0)  # DeepInfer V4.1-Flash: ~890 bytes/token


DEFAULT_HARDWARE_COSTS = {
    # DeepInfer chart: ~85k tok/s/GPU at 16-64k-token batches, 4-GPU prefill instance;
    # store read 4 x 6.25 GB/s (3FS: ~400 Gbps per 8 GPUs).
    "sm100": HardwareCost(prefill_tokens_per_s=340_000.0, kv_load_bytes_per_s=25e9),
    # ASSUMPTION (no published Ascend 950 figures): 0.6 x sm100, as the sim profile.
    "ascend950": HardwareCost(prefill_tokens_per_s=204_000.0, kv_load_bytes_per_s=25e9),
}


class RouterSettings(_Frozen):
    policy: str = "estimated_ttft"  # prefill and unified pools
    decode_policy: str = "least_load"  # decode pools: load per DP rank
    pool_policies: dict[str, str] = Field(default_factory=dict)  # pool name -> policy override
    session_affinity: bool = False  # keep a `user` (or x-session-id header) on its worker while load allows
    pd_bypass_tokens: int = Field(256, ge=0)  # uncached tokens at or below this skip the prefill pool
    admission_queued_tokens: int = Field(0, ge=0)  # per pool; 0 = no admission control
    hardware: dict[str, HardwareCost] = Field(default_factory=lambda: dict(DEFAULT_HARDWARE_COSTS))
    inflight_lease_s: float = Field(60.0, gt=0)  # shared in-flight reservations expire if a replica dies
    kv_events_interval_s: float = Field(0.05, gt=0)


class TracingSettings(_Frozen):
    """OpenTelemetry tracing (deepinfer_gateway/tracing.py); needs the `otel` extra. Off by default."""

    enabled: bool = False
    exporter: Literal["otlp", "console", "none"] = "otlp"
    endpoint: str | None = None  # OTLP/HTTP traces endpoint; None: the exporter's default / OTEL_* env
    service_name: str = "deepinfer-gateway"
    sample_ratio: float = Field(1.0, ge=0.0, le=1.0)  # of root traces; a sampled caller's traceparent wins


class ImageSettings(_Frozen):
    """Image inputs (recipe_bridge/images.py): limits, and whether remote URLs are fetched."""

    max_images: int = Field(16, ge=0)  # per request
    max_image_bytes: int = Field(10 * 1024 * 1024, ge=1)  # encoded bytes per image
    max_total_image_bytes: int = Field(32 * 1024 * 1024, ge=1)  # encoded bytes per request
    remote_fetch: bool = False  # off: only data URLs / inline images
    allow: tuple[str, ...] = ()  # hosts or CIDRs fetched even when not globally routable


class GatewaySettings(_Frozen):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    model_names: tuple[str, ...] = ("DeepSeek-V4.1-Flash",)
    model_aliases: ModelAliases = Field(default_factory=lambda: dict(BUILTIN_ALIASES))  # model_catalog.py
    tokenizer_path: str | None = None
    context_limit: int = Field(131_072, ge=1)
    max_body_bytes: int = Field(32 * 1024 * 1024, ge=1024)
    images: ImageSettings = ImageSettings()
    redis_url: str | None = None
    redis_cluster: bool = False  # redis_url names a node of a Redis Cluster (redis_conn.py)
    # One replica per worker writes its KV events to Redis for this long, renewed (0: all do).
    kv_writer_lease_s: float = Field(3.0, ge=0)
    workers: tuple[WorkerSpec, ...] = ()
    max_attempts: int = Field(3, ge=1)  # tries before the first token reaches the client
    router: RouterSettings = RouterSettings()
    admin_keys_required: bool = True  # admin endpoints need an API key with admin = true
    health: HealthSettings = HealthSettings()
    connect_timeout_s: float = Field(2.0, gt=0)
    first_event_timeout_s: float = Field(30.0, gt=0)
    between_events_timeout_s: float = Field(120.0, gt=0)
    # SIGTERM: /ready answers 503 and the listener stays open this long (probing load balancers
    # stop sending), then in-flight streams get shutdown_grace_s to finish.
    shutdown_delay_s: float = Field(0.0, ge=0)
    shutdown_grace_s: float = Field(30.0, ge=0)  # SIGTERM: let in-flight streams finish this long
    api_keys: tuple[ApiKey, ...] = ()  # empty and api_keys_in_redis off: authentication off
    api_keys_in_redis: bool = False  # also accept keys stored in Redis (dgw:apikey:{sha256})
    log_format: Literal["text", "json"] = "text"  # json: one object per line with request_id (gateway/logs.py)
    access_log: bool = True  # one INFO line per HTTP request (logger deepinfer_gateway.access)
    tracing: TracingSettings = TracingSettings()


def load_settings(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> GatewaySettings:
    data: dict[str, Any] = {}
    if path:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    for name, field in GatewaySettings.model_fields.items():
        env = os.environ.get(f"DGW_{name.upper()}")
        if env is not None and field.annotation in (str, int, float, bool, str | None):
            data[name] = env
    data.update({k: v for k, v in (overrides or {}).items() if v is not None})
    return GatewaySettings.model_validate(data)
