"""Hardware profiles of the simulated engine, read from a user-editable TOML file.

A profile is one engine instance's shape (GPUs, DP ranks, batch limits, KV memory,
bandwidths) plus the two throughput curves the step model interpolates. The bundled
`profiles.toml` holds `sm100` (calibrated to DeepInfer's published charts) and
`ascend950` (an explicitly labelled assumption). A table may say `derived_from = "x"`
to inherit profile x's fields, with `speed_factor` scaling both curves.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from deepinfer_gateway.core.protocol import KV_BLOCK_TOKENS, Hardware

BUNDLED_PROFILES = Path(__file__).with_name("profiles.toml")

DEFAULT_KV_MEMORY_BYTES_PER_GPU = 40e9
Curve = tuple[tuple[float, float], ...]


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    hardware: Hardware
    kv_format: str
    prefill_points: Curve  # (batch tokens per GPU, tokens/s per GPU)
    decode_points: Curve  # (running requests per DP rank, tokens/s per user)
    gpus_per_instance: int = 4
    dp_ranks: int = 4
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 16384
    max_model_len: int = 131072
    kv_bytes_per_token: int = 890
    memory_capacity_blocks: int = 0
    store_read_bytes_per_s: float = 25e9
    transfer_bytes_per_s: float = 200e9
    # Speculative decoding (DSpark/MTP): each decode step proposes `nextn` draft tokens per
    # request, each accepted with probability `acceptance`; the step emits 1 + the accepted
    # ones. DeepInfer's published sweep: nextn 3 at 75% acceptance, 3.25 tokens per step.
    nextn: int = 3
    acceptance: float = 0.75
    speed_factor: float = 1.0  # already applied to the curves; kept for display
    # vLLM's --scheduling-policy: "fcfs", or "priority" (requests' `priority`, with preemption; core.py)
    scheduling_policy: str = "fcfs"

    @property
    def decode_tokens_per_step(self) -> float:
        """The mean tokens one decode step emits per request."""
        return 1 + self.nextn * self.acceptance

    @property
    def gpus_per_rank(self) -> float:
        return self.gpus_per_instance / self.dp_ranks

    def kv_bytes(self, tokens: int) -> int:
        return tokens * self.kv_bytes_per_token


_SCALARS = {
    "kv_format": str,
    "gpus_per_instance": int,
    "dp_ranks": int,
    "max_num_seqs": int,
    "max_num_batched_tokens": int,
    "max_model_len": int,
    "kv_bytes_per_token": int,
    "memory_capacity_blocks": int,
    "store_read_bytes_per_s": float,
    "transfer_bytes_per_s": float,
    "nextn": int,
    "acceptance": float,
    "scheduling_policy": str,
}
_KNOWN = set(_SCALARS) | {
    "hardware",
    "prefill_points",
    "decode_points",
    "derived_from",
    "speed_factor",
    "kv_memory_bytes_per_gpu",
}


def _curve(points: Any, where: str) -> Curve:
    curve = tuple((float(x), float(y)) for x, y in points)
    if not curve or any(x <= 0 or y <= 0 for x, y in curve) or list(curve) != sorted(curve):
        raise ValueError(f"{where}: points must be positive and sorted by their first value")
    return curve


def _build(name: str, tables: dict[str, dict[str, Any]], seen: tuple[str, ...] = ()) -> HardwareProfile:
    if name not in tables:
        raise KeyError(f"no hardware profile named {name!r} (have: {', '.join(sorted(tables))})")
    if name in seen:
        raise ValueError(f"profile {name!r}: derived_from cycle")
    table = tables[name]
    unknown = set(table) - _KNOWN
    if unknown:
        raise ValueError(f"profile {name!r}: unknown field(s) {', '.join(sorted(unknown))}")

    factor = float(table.get("speed_factor", 1.0))
    if "derived_from" in table:
        base = _build(str(table["derived_from"]), tables, (*seen, name))
    else:
        base = HardwareProfile(
            name=name,
            hardware=Hardware(table["hardware"]),
            kv_format=str(table["kv_format"]),
            prefill_points=_curve(table["prefill_points"], f"{name}.prefill_points"),
            decode_points=_curve(table["decode_points"], f"{name}.decode_points"),
        )
    fields: dict[str, Any] = {k: cast(table[k]) for k, cast in _SCALARS.items() if k in table}
    profile = replace(
        base,
        name=name,
        hardware=Hardware(table.get("hardware", base.hardware)),
        prefill_points=tuple((x, y * factor) for x, y in base.prefill_points),
        decode_points=tuple((x, y * factor) for x, y in base.decode_points),
        speed_factor=base.speed_factor * factor,
        **fields,
    )
    if "memory_capacity_blocks" not in table:  # size it from HBM left for KV
        per_gpu = float(table.get("kv_memory_bytes_per_gpu", DEFAULT_KV_MEMORY_BYTES_PER_GPU))
        block_bytes = profile.kv_bytes_per_token * KV_BLOCK_TOKENS
        profile = replace(profile, memory_capacity_blocks=int(per_gpu * profile.gpus_per_instance // block_bytes))
    if profile.nextn < 0 or not 0.0 <= profile.acceptance <= 1.0:
        raise ValueError(f"profile {name!r}: nextn must be >= 0 and acceptance within [0, 1]")
    if profile.scheduling_policy not in ("fcfs", "priority"):
        raise ValueError(f"profile {name!r}: scheduling_policy must be \"fcfs\" or \"priority\"")
    if profile.dp_ranks < 1 or profile.gpus_per_instance < 1 or profile.memory_capacity_blocks < 1:
        raise ValueError(f"profile {name!r}: dp_ranks, gpus_per_instance and memory capacity must be >= 1")
    return profile


def load_profiles(path: str | Path | None = None) -> dict[str, HardwareProfile]:
    """All profiles of a TOML file (the bundled one by default), by table name."""
    with open(path or BUNDLED_PROFILES, "rb") as f:
        tables = tomllib.load(f)
    return {name: _build(name, tables) for name in tables}


def load_profile(name: str, path: str | Path | None = None) -> HardwareProfile:
    return load_profiles(path)[name]
