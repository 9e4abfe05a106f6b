"""Routing policy settings: one frozen model per policy, holding that policy's parameters.

A policy is configured by name alone (`policy = "round_robin"`: every parameter at its
default) or as a table naming it (`[router.policy] name = "cache_aware"`, `min_match =
0.2`). `PolicyConfig` is the discriminated union of the variants on `name`; a string is
read as the table `{name = string}`. The defaults are the values the policies were tuned
with (docs/policies.md). Pydantic only: the settings models (models.py) and the admin API import it,
router/policies.py builds a policy from it (`make_policy`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, TypeAdapter, ValidationError


class _Variant(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RoundRobinConfig(_Variant):
    """Cycles through the pool's workers; no parameters."""

    name: Literal["round_robin"] = Field("round_robin", description="Policy name.")


class LeastLoadConfig(_Variant):
    """Fewest queued prefill tokens, then fewest running sequences; no parameters."""

    name: Literal["least_load"] = Field("least_load", description="Policy name.")


class PowerOfTwoConfig(_Variant):
    """The least loaded of a few workers drawn at random: robust to stale load reports without herding."""

    name: Literal["power_of_two"] = Field("power_of_two", description="Policy name.")
    choices: int = Field(2, ge=1, description="Candidates drawn per request; the least loaded of them wins.")
    seed: int = Field(0, description="Seed of the draw (one generator per pool).")


class _OverlapGuard(_Variant):
    """SGLang's cache-aware rule: balance when imbalanced, else the longest prefix match."""

    balance_abs_tokens: int = Field(
        32_768, ge=0,
        description="When the largest and smallest queues differ by more than this many tokens (and by "
                    "balance_rel), the least loaded worker wins whatever the prefix.")
    balance_rel: float = Field(
        1.5, ge=1.0,
        description="The other half of that rule: the largest queue exceeds this many times the smallest.")
    min_match: float = Field(
        0.1, ge=0.0, le=1.0,
        description="Share of the prompt the longest prefix match must cover to win; below it, least load.")


class CacheAwareConfig(_OverlapGuard):
    """Longest memory-tier prefix from the KV index (engine KV events), with a load balance rule."""

    name: Literal["cache_aware"] = Field("cache_aware", description="Policy name.")


class PrefixApproxConfig(_OverlapGuard):
    """Longest prefix by this gateway's own routing history (no engine feedback), with a load balance rule."""

    name: Literal["prefix_approx"] = Field("prefix_approx", description="Policy name.")
    capacity: int = Field(
        1_000_000, ge=1,
        description="Block hashes remembered per pool; the least recently routed are forgotten first.")


class EstimatedTtftConfig(_Variant):
    """Minimum estimated time to first token (per-tier overlap, queue, hardware speed), sticky to
    the longest memory prefix, with a load guard (router/policies.py)."""

    name: Literal["estimated_ttft"] = Field("estimated_ttft", description="Policy name.")
    stick_ratio: float = Field(
        1.5, ge=1.0,
        description="Keep the worker holding the longest memory prefix while its estimate is at most this "
                    "many times the cheapest's, plus stick_s.")
    stick_s: float = Field(0.05, ge=0.0, description="Seconds added to the stickiness margin.")
    guard_ratio: float = Field(
        2.0, ge=1.0,
        description="Load guard: a pick whose queue exceeds this many times the mean queue, plus guard_tokens, "
                    "gives way to the cheapest worker under that bound.")
    guard_tokens: int = Field(65_536, ge=0, description="Queued tokens added to the load guard's bound.")
    lockstep: bool = Field(
        False,
        description="Price the DP ranks' lockstep from the requests sent to a worker and not yet scheduled there: "
                    "a request's step lasts as long as the largest prefill in it, so it waits for theirs, and its "
                    "own, when larger, delays each of them (router/policies.py). Conversations: TTFT p50 down "
                    "about a quarter, p99 up and hit rate down a little (docs/policies.md).")
    lockstep_under_way: bool = Field(
        False,
        description="With lockstep: also wait out the step under way, from the largest prefill the worker "
                    "scheduled and has not answered (agent sessions with routed_prefix_s: TTFT p99 0.93x through the "
                    "real gateway, 0.78x in simulate; conversations: higher p99; docs/policies.md).")
    step_tokens: int = Field(
        16_384, ge=1,
        description="Lockstep: the most prompt tokens a DP rank prefills in one step (the engines' chunked-prefill "
                    "budget, DeepInfer's max_num_batched_tokens); a larger prefill takes several steps.")


class SessionAffinityConfig(_Variant):
    """Keeps a session on its last worker, and a subagent's first request on its parent's (docs/api.md "Sessions")."""

    enabled: bool = Field(False, description="Keep a session on its worker while load allows.")
    max_queue_tokens: int = Field(
        65_536, ge=0,
        description="A session leaves its worker once that worker's queue exceeds this many tokens.")
    capacity: int = Field(100_000, ge=1, description="Sessions remembered per pool; the least recent forgotten first.")
    lineage_max_queue_tokens: int = Field(
        8_192, ge=0,
        description="A subagent's first request goes to its parent's worker (where their shared system prompt "
                    "and tools are cached) while that worker's queue is at most this many tokens; past it (the "
                    "parent's worker loaded, or its parallel subagents would queue behind each other) the pool "
                    "policy places it. 0: only onto an idle queue.")
    ttl_s: float = Field(
        3_600.0, gt=0,
        description="With Redis: how long the replicas' shared store remembers a session's worker after its "
                    "last request.")


PolicyVariant = (RoundRobinConfig | LeastLoadConfig | PowerOfTwoConfig | PrefixApproxConfig | CacheAwareConfig
                 | EstimatedTtftConfig)
POLICIES: tuple[str, ...] = tuple(sorted(variant.model_fields["name"].default for variant in get_args(PolicyVariant)))


def _named(value: Any) -> Any:
    """A bare name is the policy with its defaults; an unknown name fails with the names to choose from."""
    if isinstance(value, str):
        value = {"name": value}
    if isinstance(value, Mapping):
        name = value.get("name")
        if name is None:
            raise ValueError(f"a policy table needs a name: one of {', '.join(POLICIES)}")
        if name not in POLICIES:
            raise ValueError(f"unknown routing policy {name!r}; choose one of {', '.join(POLICIES)}")
    return value


PolicyConfig = Annotated[PolicyVariant, Field(discriminator="name"), BeforeValidator(_named)]
_ADAPTER: TypeAdapter[PolicyVariant] = TypeAdapter(PolicyConfig)


def _affinity(value: Any) -> Any:
    return {"enabled": value} if isinstance(value, bool) else value


SessionAffinity = Annotated[SessionAffinityConfig, BeforeValidator(_affinity)]


PolicyInput = str | Mapping[str, Any] | PolicyVariant  # a name, a table, or a variant


def parse_policy(value: PolicyInput) -> PolicyVariant:
    """A policy name, table or variant -> its validated variant. Raises ValueError naming the
    parameter at fault (`stick_ratio: Input should be greater than or equal to 1`)."""
    try:
        return _ADAPTER.validate_python(value)
    except ValidationError as e:
        raise ValueError("; ".join(_problem(error) for error in e.errors())) from None


def _problem(error: Any) -> str:
    # loc[0] is the variant's tag: the parameter path starts after it.
    where = ".".join(str(part) for part in error["loc"][1:])
    reason = "unknown parameter" if error["type"] == "extra_forbidden" else error["msg"].removeprefix("Value error, ")
    return f"{where}: {reason}" if where else reason
