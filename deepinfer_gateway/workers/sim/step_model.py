"""Step-time model: how long one engine iteration takes, from a profile's curves.

Pure functions, no clock. The curves are DeepInfer's published chart points
(profiles.toml): prefill throughput per GPU against the batch per GPU, and decode
speed per user against running requests per DP rank. Between points we interpolate
piecewise-linearly in log(batch), the axis the charts use; outside them we clamp to
the nearest point (a conservative choice: no extrapolated speed-ups).

One DP rank processes its own batch; ranks of an instance step in lockstep (the MoE
layers are shared through expert parallelism), so an instance's step lasts as long as
its slowest rank.
"""

from __future__ import annotations

import math
from bisect import bisect_left

from deepinfer_gateway.workers.sim.profiles import Curve, HardwareProfile


def interpolate_log(curve: Curve, x: float) -> float:
    """y at x, linear in log(x) between points, clamped outside the curve."""
    if x <= curve[0][0]:
        return curve[0][1]
    if x >= curve[-1][0]:
        return curve[-1][1]
    i = bisect_left([p[0] for p in curve], x)
    (x0, y0), (x1, y1) = curve[i - 1], curve[i]
    t = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
    return y0 + t * (y1 - y0)


def prefill_seconds(profile: HardwareProfile, tokens_per_rank: int) -> float:
    """One DP rank prefilling `tokens_per_rank` tokens (its GPUs share the batch)."""
    if tokens_per_rank <= 0:
        return 0.0
    per_gpu = tokens_per_rank / profile.gpus_per_rank
    return per_gpu / interpolate_log(profile.prefill_points, per_gpu)


def decode_seconds(profile: HardwareProfile, running_per_rank: int) -> float:
    """One decode iteration of a DP rank with `running_per_rank` requests (one token each,
    or `decode_tokens_per_step` on average with speculative decoding: the chart speeds
    already include DeepInfer's MTP, so a step lasts as long as its mean group takes; the
    per-user speed is kept on average, whatever a step's draws)."""
    if running_per_rank <= 0:
        return 0.0
    per_user = interpolate_log(profile.decode_points, running_per_rank)
    return profile.decode_tokens_per_step / per_user


def mixed_seconds(profile: HardwareProfile, prefill_tokens: int, decoding: int) -> float:
    """A chunked-prefill step: the prefill chunk plus one decode iteration, serially."""
    return prefill_seconds(profile, prefill_tokens) + decode_seconds(profile, decoding)


def kv_load_seconds(profile: HardwareProfile, tokens: int, bytes_per_s: float) -> float:
    """Moving `tokens` of KV at `bytes_per_s` (store read or direct PD transfer)."""
    return profile.kv_bytes(tokens) / bytes_per_s if tokens > 0 else 0.0
