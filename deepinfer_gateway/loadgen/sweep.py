"""Sweeps: several bench runs, one per point, each in its own subdirectory, plus a Pareto chart.

- `rate`: open loop at each `--speedup` value (trace clock x value).
- `concurrency`: closed loop at each concurrency.
- `policy`: one run per routing-policy name. The target is reconfigured before each
  point by a `PolicyConfigurer` (policy name -> None): for DeepInfer Gateway,
  `GatewayRouting.set` (`PUT /admin/routing`, admin key). Later points start with the
  cache earlier points left: compare policies on a cold target each (bench/policies.py
  restarts the cluster per policy) when hit rates matter.

`sweep.json` lists each point's directory and headline figures; `pareto.png` is the chart.
"""

from __future__ import annotations

import dataclasses
import json
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any

from deepinfer_gateway.loadgen import plots
from deepinfer_gateway.loadgen.run import BenchConfig, run_bench

PolicyConfigurer = Callable[[str], None]
SWEEPS = ("rate", "concurrency", "policy")


class SweepError(RuntimeError):
    """The target could not be reconfigured for a sweep point."""


class GatewayRouting:
    """A DeepInfer Gateway's routing policies through its admin API (`/admin/routing`).
    With several gateway replicas, point `url` at each one: every replica has its own."""

    def __init__(self, url: str, admin_key: str) -> None:
        self.url = url.rstrip("/").removesuffix("/v1") + "/admin/routing"
        self.headers = {"Authorization": f"Bearer {admin_key}", "Content-Type": "application/json"}

    def get(self) -> dict[str, Any]:
        return self._call("GET", None)

    def set(self, policy: str) -> None:
        self._call("PUT", {"policy": policy})

    def _call(self, method: str, body: dict[str, Any] | None) -> dict[str, Any]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url, data=data, method=method, headers=self.headers)
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return dict(json.load(response))
        except urllib.error.HTTPError as exc:
            detail = exc.read()[:300].decode(errors="replace")
            raise SweepError(f"{method} {self.url} {body or ''}: HTTP {exc.code} {detail}") from None
        except (urllib.error.URLError, OSError) as exc:
            raise SweepError(f"{method} {self.url}: {exc}") from None


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
        raise ValueError("a policy sweep needs a callable that reconfigures the target's routing policy")
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
