"""`[flow_control]`: the queue between admission and placement (router/flow.py, docs/api.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

ServiceTier = Literal["priority", "default", "flex"]


class FlowControlSettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = Field(
        False,
        description="Hold requests in the gateway while their pool is saturated and start them by tier, fair "
                    "share and deadline; refuse (429 + Retry-After) those that cannot start in time. Off: every "
                    "request goes to the engines' queues at once (only router.admission_queued_tokens refuses).")
    max_engine_wait_ms: float = Field(
        200.0, gt=0,
        description="A worker is saturated when its estimated queue wait (queued prefill tokens / its hardware's "
                    "prefill_tokens_per_s) reaches this.")
    max_engine_waiting: int = Field(
        4, ge=1, description="... or its engine reports this many requests waiting per DP rank.")
    kv_usage_limit: float = Field(0.95, gt=0, le=1, description="... or its KV usage reaches this fraction.")
    flex_reserve: int = Field(
        0, ge=0,
        description="Of a pool's max_engine_waiting x DP ranks, requests kept for tiers above flex (flex still "
                    "gets one), so a priority or default request queues behind less flex work in an engine; costs "
                    "flex throughput (bench/overload.py smoke: 7.6 -> 5.1 requests/s of goodput at 1, no TTFT "
                    "gain where the wait is for a decode slot).")
    flex_max_share: float = Field(
        1.0, gt=0, le=1,
        description="Of a pool's sequence slots (its workers' max_num_seqs x DP ranks), the share flex requests "
                    "may hold, from their start to their end: the rest stays free for the tiers above, which then "
                    "start at once however deep the flex backlog, on engines that neither prioritise nor preempt. "
                    "1: no cap. A pool with a worker of unknown slots (a vllm or openai worker without "
                    "max_num_seqs) has no cap, nor one whose workers all preempt for a slot (their info's "
                    "priority_preemption: the tiers above preempt flex there).")
    flex_yield_window_ms: float = Field(
        0.0, ge=0,
        description="Flex also leaves free as many slots as the tiers above held at most at once in the pool over "
                    "this window (this gateway's count): a reserve that follows their demand, all of it flex's while "
                    "they are idle. 0: off (flex_max_share alone). Needs the pool's slots, as flex_max_share does, "
                    "and does not apply where the workers preempt.")
    priority_ttft_ms: float = Field(2_000.0, gt=0, description="TTFT target of service_tier priority requests.")
    default_ttft_ms: float = Field(10_000.0, gt=0, description="TTFT target of default (and auto) requests.")
    flex_ttft_ms: float = Field(60_000.0, gt=0, description="TTFT target of flex requests.")
    max_slo_ttft_ms: float = Field(
        600_000.0, gt=0, description="Largest TTFT target a request may set with x-slo-ttft-ms (larger: 400).")
    max_queued_per_pool: int = Field(1024, ge=1, description="Requests waiting per pool; past it the lowest tier "
                                                           "is refused first.")
    max_queued_per_tenant: int = Field(256, ge=1, description="Requests one tenant may have waiting per pool.")
    expected_output_tokens: int = Field(
        256, ge=0,
        description="Output tokens a request is expected to cost in the fair share (at most its max_tokens), "
                    "besides its prompt.")
    tenant_weights: dict[str, float] = Field(
        default_factory=dict,
        description="Tenant (an API key's tenant, else its name) -> weight of its fair share; absent: 1.")
    shared_share: bool = Field(
        True,
        description="With redis.url: the routers queueing for a pool (gateway replicas, serve --processes, EPPs) "
                    "keep one fair share between tenants through Redis, each yielding a start to another's "
                    "queued request of a higher tier or of a tenant served less (docs/api.md). Off: each keeps "
                    "its own.")
    share_interval_ms: float = Field(
        100.0, gt=0, le=10_000,
        description="How often a router with flow-control traffic exchanges its queues and its tenants' service "
                    "with the others (shared_share); a report older than 10 intervals counts for nothing.")
    share_half_life_ms: float = Field(
        10_000.0, gt=0,
        description="With shared_share: a tenant's service (tokens started / weight) halves over this; the share "
                    "evens out the service of the last few half-lives.")
    tier_header: bool = Field(
        False,
        description="Honour x-dgw-service-tier (priority|default|flex), set by a trusted proxy in front, over the "
                    "request's and the key's tier. Off: the header is refused (400), so a client cannot raise "
                    "its own tier with it.")

    def ttft_target_s(self, tier: str) -> float:
        return {"priority": self.priority_ttft_ms, "default": self.default_ttft_ms,
                "flex": self.flex_ttft_ms}[tier] / 1000.0
