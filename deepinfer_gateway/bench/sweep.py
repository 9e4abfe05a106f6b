"""Sweeps: several bench runs, one per point, each in its own subdirectory, plus a Pareto chart.

- `rate`: open loop at each `--speedup` value (trace clock x value).
- `concurrency`: closed loop at each concurrency.
- `policy`: one run per routing-policy name. The target must be reconfigured between
  points, so the caller passes a `PolicyConfigurer` (policy name -> None, e.g. restart
  the gateway with that policy). Not wired to the CLI yet: the router's policies are
  landing separately; `bench --sweep policy` says so.

`sweep.json` lists each point's directory and headline figures; `pareto.png` is the chart.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from typing import Any

from deepinfer_gateway.bench import plots
from deepinfer_gateway.bench.run import BenchConfig, run_bench

PolicyConfigurer = Callable[[str], None]
SWEEPS = ("rate", "concurrency", "policy")


def _point(config: BenchConfig, kind: str, value: str) -> BenchConfig:
    out = config.out / f"{kind}-{value}"
    if kind == "rate":
        replay = dataclasses.replace(config.replay, mode="open", speedup=float(value))
    elif kind == "concurrency":
        replay = dataclasses.replace(config.replay, mode="closed", concurrency=int(value))
    else:
        replay = config.replay
    return dataclasses.replace(config, out=out, replay=replay)


def run_sweep(config: BenchConfig, kind: str, values: Sequence[str],
              configure_policy: PolicyConfigurer | None = None) -> dict[str, Any]:
    if kind not in SWEEPS:
        raise ValueError(f"sweep must be one of {SWEEPS}")
    if kind == "policy" and configure_policy is None:
        raise NotImplementedError(
            "--sweep policy needs a callable that reconfigures the target's routing policy; "
            "it is wired once the router's policies are configurable at run time")
    points: list[tuple[str, dict[str, Any]]] = []
    for value in values:
        point = _point(config, kind, value)
        hook = (lambda v=value: configure_policy(v)) if kind == "policy" and configure_policy else None
        summary = run_bench(point, before_run=hook)
        points.append((f"{kind}={value}", summary))
    index = {
        "sweep": kind,
        "points": [
            {"label": label, "dir": f"{kind}-{value}", "requests_per_s": s["throughput"]["requests_per_s"],
             "output_tokens_per_s": s["throughput"]["output_tokens_per_s"],
             "output_tokens_per_s_per_gpu": s["throughput"]["output_tokens_per_s_per_gpu"],
             "per_user_output_tokens_per_s_p50": s["per_user_output_tokens_per_s"]["p50"],
             "ttft_p50_s": s["ttft_s"]["p50"], "ttft_p99_s": s["ttft_s"]["p99"]}
            for (label, s), value in zip(points, values, strict=True)
        ],
    }
    config.out.mkdir(parents=True, exist_ok=True)
    (config.out / "sweep.json").write_text(json.dumps(index, indent=2) + "\n")
    if config.plots:
        plots.pareto(points, config.out / "pareto.png", kind)
    return index
