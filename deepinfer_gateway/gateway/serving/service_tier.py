"""A request's flow-control ticket: its tier, tenant, weight and TTFT target (flow_gate.py).

The tier, highest authority first: the operator's `x-dgw-service-tier` header (only with
`flow_control.tier_header`, set by a trusted proxy), else the request's `service_tier`
(OpenAI: auto|default|flex|priority; Anthropic: auto|standard_only) never above its key's
`service_tier`, which `auto` and an absent field get. The TTFT target: `x-slo-ttft-ms`, else
the tier's. The tenant is the key's scope (its tenant, else the key): the unit of fair share.

With flow control off, nothing here can be honoured: flex, priority and the two headers are
refused (400) rather than accepted and ignored.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from deepinfer_gateway.config import ApiKey, FlowControlSettings
from deepinfer_gateway.core import headers as names
from deepinfer_gateway.core.errors import BridgeError
from deepinfer_gateway.gateway.serving.auth import hash_key, presented_key
from deepinfer_gateway.gateway.serving.flow_gate import FlowTicket
from deepinfer_gateway.recipe_bridge.prepare import ApiProtocol, PreparedRequest
from deepinfer_gateway.router.flow import Tier, resolve_tier, tier_of

# OpenAI echoes the tier a request ran at; Anthropic's usage.service_tier says standard or priority.
_ECHOES = (ApiProtocol.CHAT, ApiProtocol.RESPONSES)


def flow_ticket(settings: FlowControlSettings, key: ApiKey, prepared: PreparedRequest,
                headers: Mapping[str, str]) -> FlowTicket | None:
    """The request's ticket (None with flow control off); sets `prepared.service_tier_echo`.
    BridgeError (400) for a value that cannot be honoured."""
    asked = prepared.service_tier
    header_tier = headers.get(names.SERVICE_TIER)
    slo = headers.get(names.SLO_TTFT_MS)
    if not settings.enabled:
        for given, what in ((header_tier, names.SERVICE_TIER), (slo, names.SLO_TTFT_MS)):
            if given is not None:
                raise BridgeError(400, f"{what} needs flow control, which is off on this gateway.", param=what)
        if asked in ("flex", "priority"):
            raise BridgeError(400, f"service_tier: {asked!r} is not supported: flow control is off on this gateway "
                                   "(one service tier, default).", param="service_tier")
        if asked is not None and prepared.protocol in _ECHOES:
            prepared.service_tier_echo = "default"
        return None
    tier = _header_tier(settings, header_tier) if header_tier is not None else resolve_tier(
        asked, tier_of(key.service_tier), prepared.protocol is ApiProtocol.MESSAGES)
    target_s = _slo_s(settings, slo) if slo is not None else settings.ttft_target_s(tier.label)
    if prepared.protocol in _ECHOES:
        prepared.service_tier_echo = tier.label
    elif prepared.protocol is ApiProtocol.MESSAGES and tier is Tier.PRIORITY:
        prepared.service_tier_echo = "priority"  # Anthropic's usage.service_tier; otherwise its "standard"
    return FlowTicket(tier=tier, tenant=key.scope, weight=settings.tenant_weights.get(key.tenant or key.name, 1.0),
                      target_s=target_s,
                      expected_output=min(prepared.sampling.max_tokens, settings.expected_output_tokens))


def epp_flow_ticket(settings: FlowControlSettings, headers: Mapping[str, str],
                    prepared: PreparedRequest) -> FlowTicket | None:
    """`flow_ticket` in the EPP, which holds no API keys (the data plane authenticates): the
    presented key (its digest, checked by no one here) is the tenant, at most the default tier
    unless the operator's header says otherwise."""
    key = ApiKey(name="epp", key_sha256=hash_key(presented_key(headers) or ""))
    return flow_ticket(settings, key, prepared, headers)


def _header_tier(settings: FlowControlSettings, value: str) -> Tier:
    if not settings.tier_header:
        raise BridgeError(400, f"{names.SERVICE_TIER} is set by the operator's proxy only (flow_control.tier_header "
                               "is off).", param=names.SERVICE_TIER)
    if value not in ("priority", "default", "flex"):
        raise BridgeError(400, f"{names.SERVICE_TIER} must be priority, default or flex.", param=names.SERVICE_TIER)
    return tier_of(value)


def _slo_s(settings: FlowControlSettings, value: str) -> float:
    try:
        ms = float(value)
    except ValueError:
        ms = math.nan
    if not (0 < ms <= settings.max_slo_ttft_ms):
        raise BridgeError(400, f"{names.SLO_TTFT_MS} must be a number of milliseconds above 0 and at most "
                               f"{settings.max_slo_ttft_ms:g}.", param=names.SLO_TTFT_MS)
    return ms / 1000.0
