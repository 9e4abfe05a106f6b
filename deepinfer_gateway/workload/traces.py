"""Trace loaders: Mooncake JSONL(.gz), Azure LLM inference CSV, built-in synthetic workloads.

`load_trace(spec)` accepts a file path, a published trace by name (`mooncake:conversation`,
`azure:code` ...: `trace_sources.SOURCES`, downloaded once and verified), or
`synthetic:chat` / `synthetic:agent` with optional `key=value` parameters
(`synthetic:chat:requests=500,rate=4,seed=1`).
Arrivals are rebased so the first request arrives at 0 s; requests with equal
timestamps keep their file order (stable sort).
"""

from __future__ import annotations

import csv
import dataclasses
import gzip
import io
from datetime import datetime
from pathlib import Path

import orjson

from deepinfer_gateway.workload.synthetic import GENERATORS
from deepinfer_gateway.workload.trace_sources import SOURCES, fetch
from deepinfer_gateway.workload.types import MOONCAKE_BLOCK_TOKENS, Trace, TraceRequest, key_values


class TraceFormatError(ValueError):
    """A trace file or spec this module cannot read; the message names the line or field."""


def _open_text(path: Path) -> io.TextIOBase:
    if path.suffix == ".gz":
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8")
    return open(path, encoding="utf-8")


def _rebased(name: str, rows: list[tuple[float, int, int, tuple[int, ...] | None]], block_size: int) -> Trace:
    rows.sort(key=lambda r: r[0])  # stable: equal timestamps keep file order
    t0 = rows[0][0] if rows else 0.0
    requests = tuple(
        TraceRequest(index=i, arrival_s=t - t0, input_length=inp, output_length=out, hash_ids=ids)
        for i, (t, inp, out, ids) in enumerate(rows)
    )
    return Trace(name, requests, block_size)


def load_mooncake(path: Path, block_size: int = MOONCAKE_BLOCK_TOKENS) -> Trace:
    """`{"timestamp": ms, "input_length", "output_length", "hash_ids": [...]}` per line."""
    rows: list[tuple[float, int, int, tuple[int, ...] | None]] = []
    with _open_text(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = orjson.loads(line)
                ids = obj.get("hash_ids")
                rows.append((float(obj["timestamp"]) / 1000.0, int(obj["input_length"]),
                             int(obj["output_length"]), tuple(int(i) for i in ids) if ids is not None else None))
            except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
                raise TraceFormatError(f"{path}:{lineno}: not a Mooncake trace line ({exc})") from None
    return _rebased(path.name, rows, block_size)


def _azure_time(text: str) -> float:
    # `2023-11-16 18:15:46.6805900`: 7 fractional digits, more than %f accepts.
    head, _, frac = text.strip().partition(".")
    return datetime.fromisoformat(head).timestamp() + (float("0." + frac) if frac else 0.0)


def load_azure(path: Path) -> Trace:
    """`TIMESTAMP,ContextTokens,GeneratedTokens` (no prefix information)."""
    rows: list[tuple[float, int, int, tuple[int, ...] | None]] = []
    with _open_text(path) as f:
        reader = csv.DictReader(f)
        for lineno, row in enumerate(reader, 2):
            try:
                rows.append((_azure_time(row["TIMESTAMP"]), int(row["ContextTokens"]),
                             int(row["GeneratedTokens"]), None))
            except (KeyError, TypeError, ValueError) as exc:
                raise TraceFormatError(f"{path}:{lineno}: not an Azure trace row ({exc})") from None
    return _rebased(path.name, rows, MOONCAKE_BLOCK_TOKENS)


def load_trace(spec: str) -> Trace:
    if spec.startswith("synthetic:"):
        kind, _, params = spec[len("synthetic:"):].partition(":")
        if kind not in GENERATORS:
            raise TraceFormatError(f"unknown synthetic workload {kind!r}; choose from {sorted(GENERATORS)}")
        return GENERATORS[kind](**key_values(params, TraceFormatError))
    if spec.partition(":")[0] in {name.partition(":")[0] for name in SOURCES}:
        return dataclasses.replace(load_file(fetch(spec)), name=spec)
    return load_file(Path(spec))


def load_file(path: Path) -> Trace:
    """A trace file, its format told by its name: Mooncake .jsonl[.gz] or Azure .csv[.gz]."""
    spec = str(path)
    if not path.exists():
        raise TraceFormatError(f"trace file {spec} does not exist")
    name = path.name.removesuffix(".gz")
    if name.endswith((".jsonl", ".json")):
        return load_mooncake(path)
    if name.endswith(".csv"):
        return load_azure(path)
    raise TraceFormatError(f"cannot tell the format of {spec}: expected .jsonl[.gz] (Mooncake) or .csv (Azure)")

