"""`bench report DIR...`: summaries side by side, one column per run directory.

A sweep directory (with sweep.json) expands to its points. Rows are the headline
figures, latencies at every percentile any of the runs chose (`--percentiles`); a
missing or null figure prints as `-`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from deepinfer_gateway.workload.summary import PERCENTILES, percentile_key

# (label, dotted path in summary.json, format)
HEAD_ROWS: tuple[tuple[str, str, str], ...] = (
    ("target", "target", "s"),
    ("protocol", "protocol", "s"),
    ("trace", "trace", "s"),
    ("mode", "mode", "s"),
    ("speedup", "speedup", "g"),
    ("concurrency", "concurrency", "g"),
    ("requests", "requests", "d"),
    ("completed", "completed", "d"),
    ("errors", "errors", "errors"),
    ("wall s", "wall_s", ".1f"),
)
# (label, summary key, unit, format): one row per reported percentile each.
LATENCIES: tuple[tuple[str, str, str, str], ...] = (
    ("TTFT", "ttft_s", "s", ".3f"),
    ("ITL", "itl_s", "ms", "ms"),
    ("TPOT", "tpot_s", "ms", "ms"),
    ("e2e", "e2e_s", "s", ".2f"),
)
TAIL_ROWS: tuple[tuple[str, str, str], ...] = (
    ("req/s", "throughput.requests_per_s", ".2f"),
    ("output tok/s", "throughput.output_tokens_per_s", ".0f"),
    ("output tok/s/GPU", "throughput.output_tokens_per_s_per_gpu", ".0f"),
    ("hit rate total", "cache_hit_rate.total", ".3f"),
    ("hit rate memory", "cache_hit_rate.memory", ".3f"),
    ("hit rate store", "cache_hit_rate.store", ".3f"),
    ("oracle hit rate", "oracle_hit_rate", ".3f"),
    ("goodput req/s", "goodput.requests_per_s", ".2f"),
    ("goodput fraction", "goodput.fraction", ".3f"),
    ("$/M input tok", "cost.usd_per_million_input_tokens", ".3f"),
    ("$/M output tok", "cost.usd_per_million_output_tokens", ".2f"),
    ("client CPU ms/req", "client_cpu.per_request_ms", ".2f"),
    ("client cores", "client_cpu.cores_used", ".2f"),
)


def reported_percentiles(summaries: Sequence[dict[str, Any]]) -> list[float]:
    """The union of the runs' chosen percentiles (`PERCENTILES` for summaries that name none)."""
    chosen: set[float] = set()
    for s in summaries:
        chosen.update((s.get("statistics") or {}).get("percentiles") or PERCENTILES)
    return sorted(chosen)


def rows(summaries: Sequence[dict[str, Any]]) -> list[tuple[str, tuple[str, ...], str]]:
    """(label, key path, format) per table row; paths are tuples since `p99.9` holds a dot."""
    percentiles = reported_percentiles(summaries)
    latency = [(f"{label} {percentile_key(p)} {unit}", (key, percentile_key(p)), fmt)
               for label, key, unit, fmt in LATENCIES for p in percentiles]
    return ([(label, tuple(path.split(".")), fmt) for label, path, fmt in HEAD_ROWS] + latency
            + [(label, tuple(path.split(".")), fmt) for label, path, fmt in TAIL_ROWS])


def _get(summary: dict[str, Any], path: tuple[str, ...]) -> Any:
    value: Any = summary
    for key in path:
        if not isinstance(value, dict):
            return None
        value = value.get(key)
    return value


def _fmt(value: Any, spec: str) -> str:
    if value is None:
        return "-"
    if spec == "errors":
        return ",".join(f"{k}:{v}" for k, v in value.items()) or "0"
    if spec == "ms":
        return f"{value * 1e3:.1f}"
    if spec == "s":
        return str(value)
    return format(value, spec)


def load_summaries(dirs: Sequence[Path]) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for d in dirs:
        sweep = d / "sweep.json"
        if sweep.exists() and not (d / "summary.json").exists():
            for point in json.loads(sweep.read_text())["points"]:
                out.append((f"{d.name}/{point['dir']}", json.loads((d / point["dir"] / "summary.json").read_text())))
        else:
            out.append((d.name or str(d), json.loads((d / "summary.json").read_text())))
    return out


def table(runs: Sequence[tuple[str, dict[str, Any]]], markdown: bool = False) -> str:
    header = ["", *(name for name, _ in runs)]
    cells = [header] + [[label, *(_fmt(_get(s, path), spec) for _, s in runs)]
                        for label, path, spec in rows([s for _, s in runs])]
    if markdown:
        lines = ["| " + " | ".join(r) + " |" for r in cells]
        lines.insert(1, "|" + "---|" * len(header))
        return "\n".join(lines)
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(r, widths, strict=True)))
                     for r in cells)
