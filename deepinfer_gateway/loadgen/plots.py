"""PNG charts (matplotlib, Agg backend): TTFT CDF, hit rate over time, sweep Pareto.

The Pareto chart follows DeepInfer's decode sweep charts: x = per-user speed (output
tokens/s per user, 1 / TPOT p50), y = output throughput per GPU (tokens/s/GPU; per
cluster when the GPU count is unknown), one labelled point per sweep point, the
Pareto frontier drawn as a line.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from deepinfer_gateway.workload.types import RequestRecord


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def ttft_cdf(records: Sequence[RequestRecord], path: Path, title: str = "") -> None:
    plt = _pyplot()
    values = sorted(r.ttft_s for r in records if r.ok and r.ttft_s is not None)
    fig, ax = plt.subplots(figsize=(6, 4))
    if values:
        ax.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post")
        ax.set_xscale("log")
    ax.set(xlabel="time to first token (s)", ylabel="fraction of requests", title=title or "TTFT CDF", ylim=(0, 1))
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def hit_rate_over_time(summary: dict[str, Any], path: Path, title: str = "") -> None:
    plt = _pyplot()
    cache = summary["cache_hit_rate"]
    points = [(p["t_s"], p["hit_rate"]) for p in cache["over_time"] if p["hit_rate"] is not None]
    fig, ax = plt.subplots(figsize=(6, 4))
    if points:
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", ms=3, label="reported by server")
    if summary.get("oracle_hit_rate") is not None:
        ax.axhline(summary["oracle_hit_rate"], ls="--", color="gray", label="trace oracle (infinite cache)")
    ax.set(xlabel=f"time since start (s), {cache['window_s']:.0f} s windows", ylabel="prompt-token hit rate",
           ylim=(0, 1), title=title or "cache hit rate over time")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def pareto_points(points: Sequence[tuple[str, dict[str, Any]]]) -> list[tuple[str, float, float]]:
    """(label, per-user tok/s, throughput per GPU) for each sweep point with data."""
    out = []
    for label, summary in points:
        speed = summary["per_user_output_tokens_per_s"]["p50"]
        tput = summary["throughput"]
        y = tput.get("output_tokens_per_s_per_gpu") or tput.get("output_tokens_per_s")
        if speed is not None and y is not None:
            out.append((label, float(speed), float(y)))
    return out


def frontier(points: Sequence[tuple[str, float, float]]) -> list[tuple[str, float, float]]:
    """Points no other point beats on both axes, by increasing per-user speed."""
    ordered = sorted(points, key=lambda p: (-p[1], -p[2]))
    best_y = float("-inf")
    out = []
    for p in ordered:
        if p[2] > best_y:
            out.append(p)
            best_y = p[2]
    return sorted(out, key=lambda p: p[1])


def pareto(points: Sequence[tuple[str, dict[str, Any]]], path: Path, sweep: str) -> None:
    plt = _pyplot()
    data = pareto_points(points)
    per_gpu = all(s["throughput"].get("output_tokens_per_s_per_gpu") is not None for _, s in points)
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    if data:
        ax.scatter([p[1] for p in data], [p[2] for p in data], zorder=3)
        for label, x, y in data:
            ax.annotate(label, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
        front = frontier(data)
        ax.plot([p[1] for p in front], [p[2] for p in front], lw=1.5, label="Pareto frontier")
        ax.legend(loc="upper right")
    ax.set(xlabel="per-user speed (output tokens/s/user, 1/TPOT p50)",
           ylabel="output throughput (tokens/s/GPU)" if per_gpu else "output throughput (tokens/s, cluster)",
           title=f"latency-throughput sweep over {sweep}")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def by_round(summary: dict[str, Any], path: Path, title: str = "") -> None:
    """Closed-loop sessions: TTFT p50/p90 and hit rate (with the planned rate) per round index."""
    plt = _pyplot()
    rows = sorted((int(k), v) for k, v in summary.get("ttft_by_round", {}).items())
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(6, 6), sharex=True)
    for key, label in (("p50", "TTFT p50"), ("p90", "TTFT p90")):
        points = [(i, v["ttft_s"].get(key)) for i, v in rows if v["ttft_s"].get(key) is not None]
        top.plot([p[0] for p in points], [p[1] for p in points], marker="o", ms=3, label=label)
    top.set(ylabel="time to first token (s)", title=title or "sessions by round")
    top.grid(True, alpha=0.3)
    top.legend(loc="best")
    series = (("hit_rate", "reported by server", "-"), ("planned_hit_rate", "planned (perfect cache)", "--"))
    for key, label, style in series:
        points = [(i, v[key]) for i, v in rows if v.get(key) is not None]
        bottom.plot([p[0] for p in points], [p[1] for p in points], style, marker="o", ms=3, label=label)
    bottom.set(xlabel="round index in its session", ylabel="prompt-token hit rate", ylim=(0, 1))
    bottom.grid(True, alpha=0.3)
    bottom.legend(loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
