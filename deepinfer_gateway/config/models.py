"""The gateway's settings models: one frozen, validated pydantic object per table, passed in
(never a global). `GatewaySettings` is the whole configuration; `loading.load_settings` layers
the TOML file, secrets directory, `DGW_*` environment and CLI flags into it. The reference of
every field, generated from these models, is docs/config.md.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from enum import StrEnum
from typing import Annotated, Any, ClassVar, Literal, get_args

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, TypeAdapter, field_validator, model_validator

from deepinfer_gateway.config.flow import FlowControlSettings, ServiceTier
from deepinfer_gateway.config.policies import (
    EstimatedTtftConfig,
    LeastLoadConfig,
    PolicyConfig,
    PolicyInput,
    SessionAffinity,
    SessionAffinityConfig,
    parse_policy,
)
from deepinfer_gateway.config.sessions import SessionCapacitySettings
from deepinfer_gateway.core.model_catalog import BUILTIN_ALIASES, ModelAliases
from deepinfer_gateway.core.protocol import DEFAULT_MODEL, Hardware, Role, WorkloadClass


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ApiKey(_Frozen):
    """An API key record; the key itself is stored only as its SHA-256 hex digest."""

    name: str = Field(min_length=1, description="Shown in logs and errors; unique among the configured keys.")
    key_sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="SHA-256 hex digest of the key.")
    tenant: str | None = Field(
        None, min_length=1, max_length=128,
        description="Keys naming the same tenant share its stored Responses and rate-limit buckets (one client's "
                    "keys, a key being rotated); none: the key's own, reached by no other key.")
    models: tuple[str, ...] = Field((), description="Names this key may use (served names or aliases); empty: all.")
    workload_class: WorkloadClass = Field("chat", description="Selects the KV store TTL class of its requests.")
    requests_per_minute: int | None = Field(None, ge=1, description="Rate limit; none: unlimited.")
    tokens_per_minute: int | None = Field(None, ge=1, description="Prompt + output token limit; none: unlimited.")
    admin: bool = Field(False, description="May call the /admin endpoints.")
    service_tier: ServiceTier = Field(
        "default",
        description="Its requests' flow-control tier when they ask for none (or auto), and the highest they may "
                    "ask for: a request asking for more runs at this one, as its answer's service_tier says.")
    cache_isolation: bool = Field(
        False, description="Salt all its requests' prefix caching with its tenant (else the key): no other tenant's "
                           "prompt shares its KV blocks or learns from cached_tokens that they are cached; costs the "
                           "hits it would have had on other tenants' prefixes (e.g. a common system prompt).")

    def allows(self, model: str) -> bool:
        return not self.models or model in self.models

    @property
    def scope(self) -> str:
        """Whose state (stored Responses, rate-limit buckets) this key's requests use: its tenant's,
        else its own, by digest: never its name, which another key may carry too."""
        return f"tenant:{self.tenant}" if self.tenant else f"key:{self.key_sha256}"


class WorkerEngine(StrEnum):
    """The API a worker speaks."""

    DGW = "dgw"  # worker protocols v1 and v2 (docs/worker-protocol.md): sim and DeepInfer workers
    VLLM = "vllm"  # vLLM's OpenAI server, token ids in and out (docs/real-engines.md)
    OPENAI = "openai"  # any OpenAI-compatible server, text in and out (docs/real-engines.md)


class _WorkerSpecBase(_Frozen):
    """What every worker entry has, whatever its engine."""

    url: str = Field(description="Worker base URL, http:// or https://.")
    role: Role = Field(Role.UNIFIED, description="unified, prefill or decode.")
    hardware: Hardware = Field(Hardware.SM100, description="sm100 or ascend950: the router's cost model.")
    kv_format: str = Field("", description="KV cache format; empty: learned from the worker's info endpoint.")
    pool: str = Field("", description="Pool name; empty: the role's default pool.")
    id: str = Field("", description="Worker id in metrics and logs; empty: host:port of the URL.")
    max_num_seqs: int = Field(
        0, ge=0, description="Sequences its engine runs at once per DP rank (vLLM's --max-num-seqs); 0: what the "
                             "worker's info says (dgw workers say it; vllm and openai workers do not). Flow control's "
                             "flex_max_share counts these slots; a pool with a worker of unknown slots has no cap.")

    # The planner pairs prefill and decode workers by KV format alone: a vLLM worker's KV must
    # never look compatible with another engine's, nor the other way round.
    _VLLM_KV: ClassVar[bool] = False

    @field_validator("url")
    @classmethod
    def _strip_slash(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")):
            raise ValueError("worker url must start with http:// or https://")
        return v.rstrip("/")

    @model_validator(mode="after")
    def _kv_format_family(self) -> _WorkerSpecBase:
        if self.kv_format and self._VLLM_KV != self.kv_format.startswith("vllm:"):
            raise ValueError('kv_format "vllm:..." belongs to vllm workers, and a vllm worker\'s kv_format must '
                             'start with "vllm:"')
        return self

    @property
    def worker_id(self) -> str:
        return self.id or self.url.split("://", 1)[1]


_ENGINE_DOC = ("dgw (the default): worker protocol v2 or v1 (sim and DeepInfer workers); vllm: a vLLM OpenAI server, "
               "sent token ids; openai: any OpenAI-compatible server, sent text (docs/real-engines.md).")
_MODEL_DOC = "vllm, openai: the served model name to request; empty: the first of its /v1/models."


class DgwWorkerSpec(_WorkerSpecBase):
    """A worker speaking worker protocol v2 or v1 (docs/worker-protocol.md): sim and DeepInfer workers."""

    engine: Literal[WorkerEngine.DGW] = Field(WorkerEngine.DGW, description=_ENGINE_DOC)


class VllmWorkerSpec(_WorkerSpecBase):
    """A vLLM OpenAI server, sent token ids (docs/real-engines.md)."""

    _VLLM_KV: ClassVar[bool] = True
    engine: Literal[WorkerEngine.VLLM] = Field(description=_ENGINE_DOC)
    model: str = Field("", description=_MODEL_DOC)
    kv_events_endpoint: str = Field(
        "", description="vllm: its KV events publisher (ZMQ) as this gateway reaches it, e.g. tcp://10.0.0.5:5557; "
                        "empty: no KV events, no prefix-aware routing to it.")
    kv_events_replay_endpoint: str = Field(
        "", description="vllm: its KV events replay socket (ZMQ ROUTER); empty: a gap clears its index entries.")
    kv_events_topic: str = Field("", description="vllm: the topic its KV events publisher uses.")
    scheduling_policy: Literal["fcfs", "priority"] = Field(
        "fcfs", description="vllm: its --scheduling-policy. \"priority\": each request is sent its flow-control tier "
                            "as vLLM's `priority` (-1 priority, 0 default, 1 flex), which orders vLLM's waiting line "
                            "(vLLM preempts only on KV shortage, not for a sequence slot, so flow control keeps flex's "
                            "slot caps there; docs/api.md); \"fcfs\": no priority is sent (vLLM 0.32 ignores one).")


class OpenAIWorkerSpec(_WorkerSpecBase):
    """Any OpenAI-compatible server, sent text: whole requests only (docs/real-engines.md)."""

    engine: Literal[WorkerEngine.OPENAI] = Field(description=_ENGINE_DOC)
    model: str = Field("", description=_MODEL_DOC)

    @model_validator(mode="after")
    def _whole_requests(self) -> OpenAIWorkerSpec:
        if self.role is not Role.UNIFIED:
            raise ValueError("an openai worker serves whole requests: role must be unified")
        return self


WorkerSpecVariant = DgwWorkerSpec | VllmWorkerSpec | OpenAIWorkerSpec


def _engine_or_dgw(value: Any) -> Any:
    """An entry without `engine` is a worker-protocol worker. Entries written before the
    variants (admin records in Redis) carry every engine's keys: those its engine has not
    are dropped when empty (set, they are refused as unknown)."""
    if not isinstance(value, Mapping):
        return value
    engine = value.get("engine", WorkerEngine.DGW)
    known = _variant_keys().get(str(engine))
    return {**{k: v for k, v in value.items() if known is None or k in known or v != ""}, "engine": engine}


@functools.cache
def _variant_keys() -> dict[str, frozenset[str]]:
    """Each engine tag -> its variant's keys."""
    return {str(get_args(v.model_fields["engine"].annotation)[0]): frozenset(v.model_fields)
            for v in get_args(WorkerSpecVariant)}


# A worker entry: one variant per engine kind, told apart by `engine` (as routing policies by
# `name`, policies.py). A variant holds only its engine's fields.
WorkerSpec = Annotated[WorkerSpecVariant, Field(discriminator="engine"), BeforeValidator(_engine_or_dgw)]
_WORKER_SPEC: TypeAdapter[WorkerSpecVariant] = TypeAdapter(WorkerSpec)


def parse_worker_spec(value: Any) -> WorkerSpecVariant:
    """A worker entry (a mapping, or JSON text/bytes) -> its validated variant; ValidationError if invalid."""
    if isinstance(value, str | bytes):
        return _WORKER_SPEC.validate_json(value)
    return _WORKER_SPEC.validate_python(value)



KUBERNETES_SERVICE_ACCOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"


class DiscoverySpec(_Frozen):
    """Workers found by DNS (gateway/fleet/discovery.py): every address of `name`, re-resolved every `interval_s`;
    or, with kind = "kubernetes", the ready pods of an InferencePool, watched through the API server
    (gateway/fleet/kube_discovery.py)."""

    kind: Literal["dns", "kubernetes"] = Field(
        "dns",
        description="dns: name is a DNS name; kubernetes: name is an InferencePool (inference.networking.k8s.io/v1) "
                    "whose selector's ready pods, at each of its targetPorts, are the workers, followed by a watch "
                    "through the API server (RBAC: get, watch inferencepools; get, list, watch pods).")
    name: str = Field(
        min_length=1,
        description="dns: the name whose addresses are the workers: a headless Service "
                    "(dgw-decode.dgw.svc.cluster.local) or a compose service (worker-decode); with srv, an SRV name "
                    "(_http._tcp.dgw-decode.dgw.svc.cluster.local) whose records give each worker's host and port. "
                    "kubernetes: the InferencePool's name.")
    srv: bool = Field(False, description="dns: look up SRV records (host and port per worker) instead of A/AAAA.")
    port: int = Field(8100, ge=1, le=65535, description="dns: worker port for A/AAAA addresses (ignored with srv).")
    scheme: Literal["http", "https"] = Field("http", description="Scheme of the worker URLs.")
    interval_s: float = Field(
        5.0, gt=0,
        description="Seconds between two resolutions of the name; kubernetes: between two reads of the watched "
                    "pods, a change wakes it at once.")
    drain_timeout_s: float = Field(
        60.0, ge=0,
        description="A vanished address takes no new request; its requests in flight get this long to finish "
                    "before it is removed (match the pods' terminationGracePeriodSeconds).")
    engine: WorkerEngine = Field(
        WorkerEngine.DGW,
        description="dgw: each new address is probed at /v1/worker/info for role, hardware and KV format; vllm, "
                    "openai: role and hardware come from here, the health checks probe /v1/models.")
    model: str = Field("", description="vllm, openai: served model name to request; empty: the first of /v1/models.")
    kv_events_port: int | None = Field(
        None, ge=1, le=65535,
        description="vllm: port of each worker's KV events publisher (tcp://ADDRESS:PORT); none: no KV events.")
    role: Role | None = Field(None, description="Role of every worker found; none: the role each worker reports.")
    hardware: Hardware | None = Field(
        None, description="Hardware of every worker found; none: the hardware each worker reports.")
    pool: str = Field("", description="Pool of every worker found; empty: its role's default pool.")
    nameservers: tuple[str, ...] = Field(
        (),
        description='dns: resolvers to ask, "IP" or "IP:PORT" (tests: a dnsmasq on a loopback port); empty: the '
                    "system's (/etc/resolv.conf, with its search domains).")
    namespace: str = Field(
        "", description="kubernetes: the InferencePool's namespace (its pods'); empty: this pod's (its service "
                        "account's namespace file).")
    api_server: str = Field(
        "", description="kubernetes: the API server's URL; empty: in the cluster, https://$KUBERNETES_SERVICE_HOST:"
                        "$KUBERNETES_SERVICE_PORT.")
    token_file: str = Field(
        f"{KUBERNETES_SERVICE_ACCOUNT}/token",
        description="kubernetes: the bearer token's file, re-read as the kubelet rotates it; empty: no token.")
    ca_file: str = Field(
        f"{KUBERNETES_SERVICE_ACCOUNT}/ca.crt",
        description="kubernetes: the CA bundle the API server's certificate is checked against; empty: the "
                    "system's.")

    @field_validator("nameservers")
    @classmethod
    def _nameservers(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for server in v:
            host, _, port = server.rpartition(":") if server.count(":") == 1 else (server, "", "")
            if not host or (port and not port.isdigit()):
                raise ValueError(f'nameserver {server!r}: expected "IP" or "IP:PORT"')
        return v

    @model_validator(mode="after")
    def _kind_fields(self) -> DiscoverySpec:
        dns_only = {"srv", "port", "nameservers"} & self.model_fields_set
        kubernetes_only = {"namespace", "api_server", "token_file", "ca_file"} & self.model_fields_set
        if self.kind == "kubernetes" and dns_only:
            raise ValueError(f"{', '.join(sorted(dns_only))}: dns only (a kubernetes pool's ports are the "
                             "InferencePool's targetPorts)")
        if self.kind == "dns" and kubernetes_only:
            raise ValueError(f"{', '.join(sorted(kubernetes_only))}: kubernetes only (set kind = \"kubernetes\")")
        return self

    @model_validator(mode="after")
    def _engine_fields(self) -> DiscoverySpec:
        if self.engine is not WorkerEngine.DGW and self.hardware is None:
            raise ValueError("a vllm or openai pool reports no hardware: set hardware")
        if self.engine is WorkerEngine.OPENAI and self.role not in (None, Role.UNIFIED):
            raise ValueError("an openai worker serves whole requests: role must be unified")
        if self.engine is WorkerEngine.DGW and self.model:
            raise ValueError("model applies to vllm and openai workers only")
        if self.engine is not WorkerEngine.VLLM and self.kv_events_port is not None:
            raise ValueError("kv_events_port applies to vllm workers only")
        return self


class HealthSettings(_Frozen):
    interval_s: float = Field(1.0, gt=0, description="Seconds between health checks of each worker.")
    failures_to_eject: int = Field(2, ge=1, description="Consecutive failed checks that take a worker out.")
    successes_to_readmit: int = Field(1, ge=1, description="Consecutive good checks that bring it back.")


class HardwareCost(_Frozen):
    """What the router assumes of one engine instance of a hardware kind (cost model inputs)."""

    prefill_tokens_per_s: float = Field(gt=0, description="Prefill throughput of a whole instance at a typical batch.")
    kv_load_bytes_per_s: float = Field(gt=0, description="Shared-store read bandwidth of one instance.")
    kv_bytes_per_token: float = Field(890.0, gt=0, description="KV cache bytes per token (V4.1-Flash: ~890).")


DEFAULT_HARDWARE_COSTS = {
    # DeepInfer chart: ~85k tok/s/GPU at 16-64k-token batches, 4-GPU prefill instance;
    # store read 4 x 6.25 GB/s (3FS: ~400 Gbps per 8 GPUs).
    "sm100": HardwareCost(prefill_tokens_per_s=340_000.0, kv_load_bytes_per_s=25e9),
    # ASSUMPTION (no published Ascend 950 figures): 0.6 x sm100, as the sim profile.
    "ascend950": HardwareCost(prefill_tokens_per_s=204_000.0, kv_load_bytes_per_s=25e9),
}


class RouterSettings(_Frozen):
    """A policy is a name (its parameters at their defaults) or a table with `name` and parameters."""

    policy: PolicyConfig = Field(
        EstimatedTtftConfig(),
        description="Routing policy of prefill and unified pools (docs/policies.md).")
    decode_policy: PolicyConfig = Field(
        LeastLoadConfig(),
        description="Routing policy of decode pools (load per DP rank).")
    pool_policies: dict[str, PolicyConfig] = Field(
        default_factory=dict,
        description="Pool name -> policy, overriding the two above.")
    session_affinity: SessionAffinity = Field(
        SessionAffinityConfig(),
        description="Keep a session (docs/api.md \"Sessions\": agent clients' headers, `user`, ...) on its worker "
                    "while load allows, and a subagent's first request on its parent's: true, or a table.")
    pd_bypass_tokens: int = Field(
        256, ge=0,
        description="Requests with at most this many uncached tokens skip the prefill pool.")
    admission_queued_tokens: int = Field(
        0, ge=0,
        description="Per pool: refuse (429) beyond this many queued tokens; 0: no admission control.")
    hardware: dict[str, HardwareCost] = Field(
        default_factory=lambda: dict(DEFAULT_HARDWARE_COSTS),
        description="Cost model per hardware kind (sm100, ascend950).")
    inflight_lease_s: float = Field(
        60.0, gt=0,
        description="Shared in-flight reservations expire after this if a replica dies.")
    routed_prefix_s: float = Field(
        0.0, ge=0, le=60,
        description="How long a prompt just routed to a worker counts as cached there, before the worker's KV "
                    "events can say so: requests sharing its prefix that arrive meanwhile follow it instead of "
                    "each computing it elsewhere (kvcache/routed.py). Per process. 0: the KV events only.")
    kv_events_interval_s: float = Field(
        0.05, gt=0, description="Seconds between polls of each worker's KV events; a worker pushing them over worker "
                                "protocol v2 sends at most one batch per this interval (docs/worker-protocol.md).")
    decision_log: str = Field(
        "", description="A file that gets one JSON line per routed request: candidates, predictions, what the "
                        "worker reported, timings (gateway/telemetry/decision_log.py; bench/peers.py "
                        "--decision-trace). Empty: off.")

    def with_policies(self, policy: PolicyInput | None = None,
                      decode_policy: PolicyInput | None = None) -> RouterSettings:
        """A copy with other default policies (a name, table or variant each; None keeps the
        current one). ValueError names the policy and parameter at fault."""
        update = {}
        for key, given in (("policy", policy), ("decode_policy", decode_policy)):
            if given:
                try:
                    update[key] = parse_policy(given)
                except ValueError as e:
                    raise ValueError(f"{key}: {e}") from None
        return self.model_copy(update=update)


class TracingSettings(_Frozen):
    """OpenTelemetry tracing (deepinfer_gateway/core/tracing.py); needs the `otel` extra. Off by default."""

    enabled: bool = Field(False, description="Emit OpenTelemetry server spans (needs the `otel` extra).")
    exporter: Literal["otlp", "console", "none"] = Field("otlp", description="Where spans go.")
    endpoint: str | None = Field(
        None,
        description="OTLP/HTTP traces endpoint; none: the exporter's default or OTEL_* env.")
    service_name: str = Field("deepinfer-gateway", description="service.name of the spans.")
    sample_ratio: float = Field(
        1.0, ge=0.0, le=1.0,
        description="Share of root traces sampled; a sampled caller's traceparent wins.")


class ImageSettings(_Frozen):
    """Image inputs (recipe_bridge/images.py): limits, and whether remote URLs are fetched."""

    max_images: int = Field(16, ge=0, description="Images per request.")
    max_image_bytes: int = Field(10 * 1024 * 1024, ge=1, description="Encoded bytes per image.")
    max_total_image_bytes: int = Field(32 * 1024 * 1024, ge=1, description="Encoded bytes per request.")
    max_image_pixels: int = Field(
        4096 * 4096, ge=1,
        description="Pixels per image as its header declares them, checked before it is decoded (decoding costs "
                    "~4 bytes per pixel); inline images only: a fetched one is decoded as fetched.")
    max_total_image_pixels: int = Field(
        4 * 4096 * 4096, ge=1, description="Pixels per request, all its images together, checked likewise.")
    max_concurrent: int = Field(
        4, ge=1, description="Requests with images prepared (fetched, decoded, resized) at once per process; "
                             "others wait their turn.")
    remote_fetch: bool = Field(False, description="Fetch http(s) image URLs; off: only data URLs and inline images.")
    allow: tuple[str, ...] = Field((), description="Hosts or CIDRs fetched even when not globally routable.")


class ClientConnectionSettings(_Frozen):
    """Bounds on client connections (http_bounds.py) and each key's requests in flight (serving/key_slots.py)."""

    header_timeout_s: float = Field(
        10.0, gt=0,
        description="A request's headers must arrive whole this long after the connection opens (or the request "
                    "starts); else 408 and the connection closes.")
    max_header_bytes: int = Field(
        64 * 1024, ge=1024, description="Request line and headers, in bytes; beyond it 431 and the connection closes.")
    max_connections: int = Field(
        8192, ge=1,
        description="Open client connections (idle ones too); a request on a connection beyond it is answered 503.")
    write_timeout_s: float = Field(
        30.0, gt=0,
        description="A streaming client that takes no bytes for this long is cut off: its stream ends and its "
                    "request is released (aborted on the worker).")
    max_requests_per_key: int | None = Field(
        256, ge=1,
        description="Generation requests one API key may have in flight (streams included); beyond it 429. None: "
                    "no cap. Without API keys (authentication off) there is no key to cap.")


class ResponsesSettings(_Frozen):
    store: bool = Field(
        True,
        description="Keep answered Responses (their `store`, default true as OpenAI's) for previous_response_id "
                    "and GET /v1/responses/{id}, in Redis with redis.url (durable), else in memory; off: "
                    "store: true is refused.")
    ttl_s: int = Field(30 * 86_400, ge=60, description="How long a stored response is kept.")
    max_per_key: int = Field(1_000, ge=1, description="Stored responses per API key (per tenant); beyond it store: "
                                                      "true is refused (400) until some expire or are deleted.")
    max_bytes: int = Field(16 * 1024 * 1024, ge=1024, description="Largest stored response (with its input).")
    max_bytes_per_key: int = Field(
        64 * 1024 * 1024, ge=1024,
        description="Bytes of stored responses per API key (per tenant); beyond it store: true is refused (400).")
    max_total_bytes: int = Field(
        256 * 1024 * 1024, ge=1024,
        description="Bytes of stored responses of all keys together, expired ones not yet deleted included (size "
                    "Redis's maxmemory above it); beyond it responses are served unstored (store: false).")

    @model_validator(mode="after")
    def _bounds_nest(self) -> ResponsesSettings:
        if not self.max_bytes <= self.max_bytes_per_key <= self.max_total_bytes:
            raise ValueError("needs max_bytes <= max_bytes_per_key <= max_total_bytes")
        return self


class ConversationsSettings(_Frozen):
    enabled: bool = Field(
        True,
        description="The Conversations API (/v1/conversations, `conversation` on Responses), in Redis with redis.url "
                    "(durable), else in memory; off: its routes answer 404 and `conversation` is refused.")
    max_per_key: int = Field(1_000, ge=1, description="Conversations per API key (per tenant); beyond it creating one "
                                                      "is refused (400) until some are deleted (they do not expire).")
    max_items: int = Field(4_096, ge=2, description="Items per conversation; beyond it adding is refused (400).")
    max_bytes_per_key: int = Field(
        64 * 1024 * 1024, ge=1024,
        description="Bytes of conversations per API key (per tenant); beyond it a write is refused (400).")
    max_total_bytes: int = Field(
        256 * 1024 * 1024, ge=1024,
        description="Bytes of conversations of all keys together (size Redis's maxmemory above it, with "
                    "responses.max_total_bytes); beyond it a write is refused (503).")

    @model_validator(mode="after")
    def _bounds_nest(self) -> ConversationsSettings:
        if not self.max_bytes_per_key <= self.max_total_bytes:
            raise ValueError("needs max_bytes_per_key <= max_total_bytes")
        return self


class RedisSettings(_Frozen):
    """The Redis that gateway replicas (and serve --processes) share their state through.

    The prefix index, in-flight reservations, rate limits, API keys in Redis, admin changes and
    stored Responses. Without a url each process keeps them in its own memory.
    """

    url: str | None = Field(
        None,
        description="redis://, rediss:// (TLS) or unix://; its user is the ACL user the password belongs to "
                    "(redis://gateway@redis:6379/0). None: this process's memory.")
    cluster: bool = Field(False, description="url names a node of a Redis Cluster.")
    password: str | None = Field(
        None, repr=False,
        description="Redis AUTH password (DGW_REDIS__PASSWORD); none: the URL's, if any.")
    password_file: str | None = Field(
        None,
        description="File holding the Redis password (first line), re-read at each new connection; wins over "
                    "password.")
    timeout_s: float = Field(
        0.5, gt=0,
        description="Connecting to Redis, a reply, and waiting for a free connection; past it the call fails "
                    "(counted, and the shared state degrades as documented for a Redis outage).")


class GatewaySettings(_Frozen):
    host: str = Field("127.0.0.1", description="Listen address; 0.0.0.0 only where a deployment means it.")
    port: int = Field(8000, ge=0, le=65535, description="Listen port.")
    processes: int | Literal["auto"] = Field(
        1,
        description='Gateway processes behind the one port (supervisor.py); "auto" or 0: one per CPU this process '
                    "may run on. Above 1 they share state through redis.url, else through a Redis of their own on "
                    "a Unix socket (docs/deploy.md).")
    model_names: tuple[str, ...] = Field(
        (DEFAULT_MODEL,),
        description="Served model names; metrics and usage use these.")
    model_aliases: ModelAliases = Field(
        default_factory=lambda: dict(BUILTIN_ALIASES),
        description='Other names for served models: name = {model, thinking} or name = "served name"; '
                    "deepseek-chat and deepseek-reasoner are built in (model_catalog.py).")
    tokenizer_path: str | None = Field(
        None,
        description="tokenizer.json or its directory; none: the packaged DeepSeek-V4 vocabulary.")
    context_limit: int = Field(131_072, ge=1, description="Prompt + output tokens per request (max_model_len).")
    max_body_bytes: int = Field(32 * 1024 * 1024, ge=1024, description="Largest request body accepted.")
    images: ImageSettings = Field(ImageSettings(), description="Image input limits.")
    client_connections: ClientConnectionSettings = Field(
        ClientConnectionSettings(), description="Client connection and stream bounds.")
    redis: RedisSettings = Field(RedisSettings(), description="The Redis that replicas share their state through.")
    worker_token: str | None = Field(
        None, repr=False,
        description="Token sent to workers as Authorization: Bearer (DGW_WORKER_TOKEN); vLLM's --api-key.")
    worker_token_file: str | None = Field(
        None,
        description="File of worker tokens, one a line, the first sent; re-read when it changes; wins over "
                    "worker_token.")
    kv_writer_lease_s: float = Field(
        3.0, ge=0,
        description="One replica per worker writes its KV events to Redis for this long, renewed; 0: all do.")
    workers: tuple[WorkerSpec, ...] = Field((), description="Engine workers at start-up (more via /admin/workers).")
    discovery: tuple[DiscoverySpec, ...] = Field(
        (), description="Worker pools followed as they scale: DNS names whose addresses are workers, or "
                        "InferencePools whose ready pods are (docs/deploy.md).")
    max_attempts: int = Field(3, ge=1, description="Tries on other workers before the first token reaches the client.")
    router: RouterSettings = Field(RouterSettings(), description="Routing policies and cost model.")
    flow_control: FlowControlSettings = Field(
        FlowControlSettings(), description="Flow control: a fair, priority-aware queue in front of the workers.")
    session_capacity: SessionCapacitySettings = Field(
        SessionCapacitySettings(), description="Agent sessions under cache pressure: each worker's live sessions "
                                               "kept within its KV cache.")
    admin_keys_required: bool = Field(True, description="The /admin endpoints need an API key with admin = true.")
    admin_worker_hosts: tuple[str, ...] = Field(
        (),
        description="Hosts (names, matched as written, never resolved) and CIDRs that a worker added through "
                    "POST /admin/workers may point at, besides a configured [[workers]] entry's own address; "
                    "empty: only those (the workers' token goes to every worker; gateway/fleet/worker_allow.py).")
    health: HealthSettings = Field(HealthSettings(), description="Worker health checks.")
    connect_timeout_s: float = Field(2.0, gt=0, description="Connecting to a worker.")
    first_event_timeout_s: float = Field(
        30.0, gt=0,
        description="Waiting for a worker's first stream event (then retried elsewhere). Over worker protocol v2, "
                    "the worker's silence: while it streams other requests, a request queued in its engine keeps "
                    "its place up to between_events_timeout_s.")
    between_events_timeout_s: float = Field(120.0, gt=0, description="Waiting between stream events.")
    worker_protocol: Literal["auto", "v1"] = Field(
        "auto",
        description="Sim and DeepInfer workers: auto: worker protocol v2 (one multiplexed connection per worker) "
                    "where the worker speaks it, else v1; v1: one HTTP stream per request (docs/worker-protocol.md).")
    shutdown_delay_s: float = Field(
        0.0, ge=0,
        description="SIGTERM: /ready answers 503 and the listener stays open this long (load balancers stop sending).")
    shutdown_grace_s: float = Field(
        30.0, ge=0,
        description="SIGTERM, after the delay: in-flight streams get this long to finish.")
    api_keys: tuple[ApiKey, ...] = Field(
        (),
        description="Accepted keys; empty with api_keys_in_redis off: authentication off.")
    api_keys_in_redis: bool = Field(False, description="Also accept keys stored in Redis (dgw:apikey:{sha256}).")
    allow_unauthenticated: bool = Field(
        False,
        description="Serve without API keys on a host beyond loopback (anyone who reaches the port is served); "
                    "off: such a gateway refuses to start.")
    log_format: Literal["text", "json"] = Field("text", description="json: one object per line with request_id.")
    access_log: bool = Field(True, description="One INFO line per HTTP request (logger deepinfer_gateway.access).")
    metrics_port: int | None = Field(
        None, ge=1, le=65535,
        description="Serve /metrics on this port (same host) and not on the client port, which then answers it "
                    "404; none: /metrics on the client port. Every process of serve --processes binds it "
                    "(SO_REUSEPORT); any one answers for the host.")
    api_docs: bool = Field(
        True, description="/docs, /redoc and /openapi.json on the client port; off: 404 (the API's shape, admin "
                          "routes included, stays unpublished).")
    tracing: TracingSettings = Field(TracingSettings(), description="OpenTelemetry tracing.")
    responses: ResponsesSettings = Field(ResponsesSettings(), description="Stored Responses (OpenAI Responses API).")
    conversations: ConversationsSettings = Field(ConversationsSettings(),
                                                 description="Conversations (OpenAI Conversations API).")

    @field_validator("processes", mode="before")
    @classmethod
    def _process_count(cls, v: object) -> object:
        """One message for any bad value (the union would give one per member)."""
        if isinstance(v, str):
            v = v.strip().lower()
            if v == "auto":
                return v
            v = int(v) if v.lstrip("-").isdigit() else v
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError('expected a number of processes, or "auto" (0 too: one per CPU)')
        return v

    @field_validator("api_keys")
    @classmethod
    def _keys_distinct(cls, keys: tuple[ApiKey, ...]) -> tuple[ApiKey, ...]:
        # Two records of one key: which one applies would depend on their order. Two keys of one
        # name: logs and errors could not tell them apart.
        for what, values in (("name", [k.name for k in keys]), ("key_sha256", [k.key_sha256 for k in keys])):
            repeated = sorted({v for v in values if values.count(v) > 1})
            if repeated:
                shown = ", ".join(repeated) if what == "name" else f"{len(repeated)} digest(s)"
                raise ValueError(f"each key needs its own {what}; repeated: {shown}")
        return keys

    @model_validator(mode="after")
    def _keys_in_redis_need_redis(self) -> GatewaySettings:
        # Without Redis there is nowhere to look keys up: the gateway would serve everyone.
        if self.api_keys_in_redis and not self.redis.url:
            raise ValueError("api_keys_in_redis: needs redis.url (keys are looked up there)")
        return self

    @model_validator(mode="after")
    def _key_tiers_need_flow_control(self) -> GatewaySettings:
        # A key's tier means something only to flow control: without it the setting would be ignored.
        tiered = [k.name for k in self.api_keys if k.service_tier != "default"]
        if tiered and not self.flow_control.enabled:
            raise ValueError(f"api_keys: service_tier of {', '.join(tiered)} needs flow_control.enabled (a key's tier "
                             "is its requests' flow-control tier)")
        return self
