"""The `bench` and `bench report` subcommands: argument definitions and dispatch.

`cli.py` adds the `bench` parser and calls `add_arguments` / `main`; everything else
lives here so the CLI module stays a thin table of commands.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from deepinfer_gateway.loadgen.run import BenchConfig

_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(ms|s|m|h)?\s*$")
_UNITS = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def duration(text: str) -> float:
    """`2s`, `50ms`, `1.5`, `10m` -> seconds."""
    m = _DURATION.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (e.g. 2s, 50ms, 10m)")
    return float(m.group(1)) * _UNITS[m.group(2)]


def percentiles(text: str) -> tuple[float, ...]:
    """`50,90,95,99` -> (50.0, 90.0, 95.0, 99.0)."""
    from deepinfer_gateway.workload.summary import parse_percentiles

    try:
        return parse_percentiles(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--percentiles {text!r}: {exc} (e.g. 50,90,95,99)") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench_command")
    report = sub.add_parser("report", help="side-by-side table of bench summaries")
    report.add_argument("dirs", nargs="+", type=Path, help="bench output directories (each holds summary.json)")
    report.add_argument("--markdown", action="store_true", help="a Markdown table instead of plain text")

    parser.add_argument("--url", help="server root or OpenAI base URL, http://host:port[/v1] (required to run)")
    parser.add_argument("--trace", help=(
        "trace file (Mooncake .jsonl[.gz], Azure .csv), a published trace downloaded once into the cache "
        "(mooncake:conversation|synthetic|toolagent|arxiv, azure:code|conv), or synthetic:chat|agent[:k=v,...] "
        "(required to run)"))
    parser.add_argument("--out", type=Path, help="output directory (required to run)")
    parser.add_argument("--protocol", choices=["chat", "responses", "messages"], default="chat",
                        help="API the requests use: OpenAI Chat Completions, OpenAI Responses, Anthropic Messages")
    parser.add_argument("--model", default=None, help="model name (default: first of /v1/models)")
    parser.add_argument("--api-key", default="bench", help="API key the clients send")
    parser.add_argument("--speedup", type=float, default=1.0, help="open loop: trace clock x SPEEDUP")
    parser.add_argument("--concurrency", type=int, default=None,
                        help="closed loop at this many concurrent users (default: open loop)")
    parser.add_argument("--max-requests", type=int, default=None, help="first N trace requests (default: all)")
    parser.add_argument("--duration", type=duration, default=None,
                        help="send no request after this, e.g. 5m (default: the whole trace)")
    parser.add_argument("--drain-timeout", type=duration, default=60.0, help="grace after --duration, then cancel")
    parser.add_argument("--request-timeout", type=duration, default=600.0, help="per request, in seconds or e.g. 10m")
    parser.add_argument("--max-connections", type=int, default=1024, help="HTTP connection pool size of the clients")
    parser.add_argument("--slo-ttft", type=duration, default=None,
                        help="time-to-first-token goal for goodput, e.g. 2s (default: none)")
    parser.add_argument("--slo-tpot", type=duration, default=None,
                        help="time-per-output-token goal for goodput, e.g. 50ms (default: none)")
    parser.add_argument("--gpu-hour-usd", type=float, default=None,
                        help="price of a GPU hour for cost per million tokens; needs --gpus (default: no cost)")
    parser.add_argument("--gpus", type=int, default=None,
                        help="GPUs serving the target, for cost and per-GPU throughput (default: not reported)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer.json for prompt synthesis (default: DeepSeek)")
    parser.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (vLLM/SGLang) to get full outputs")
    parser.add_argument("--tool-calls", action="store_true",
                        help="session traces: rounds as calls of an offered tool and their results "
                             "(tool_choice required where a round is continued; its follower sends the result)")
    parser.add_argument("--hit-window", type=duration, default=None,
                        help="hit-rate-over-time window (default: a twentieth of the run, at least 1s)")
    parser.add_argument("--percentiles", type=percentiles, default=None,
                        help="comma list of percentiles to report, 0..100, nearest-rank (default: 50,90,99; "
                             "summary.json always keeps p50, p90 and p99)")
    parser.add_argument("--sweep", choices=["rate", "concurrency", "policy"], default=None,
                        help="one run per --sweep-values entry, varying this (default: a single run)")
    parser.add_argument("--sweep-values", default=None,
                        help="comma list: speedups, concurrencies or policy names (required by --sweep)")
    parser.add_argument("--admin-key", default=None,
                        help="--sweep policy: admin API key of the target gateway (default: --api-key)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--no-plots", action="store_true", help="no PNG charts in --out")


def _config(args: argparse.Namespace) -> BenchConfig:
    from deepinfer_gateway.loadgen.replay import ReplayConfig
    from deepinfer_gateway.loadgen.run import BenchConfig
    from deepinfer_gateway.workload.summary import PERCENTILES, CostModel, Slo

    missing = [flag for flag, value in (("--url", args.url), ("--trace", args.trace), ("--out", args.out)) if not value]
    if missing:
        raise SystemExit(f"bench: {', '.join(missing)} required")
    if args.gpu_hour_usd is not None and args.gpus is None:
        raise SystemExit("bench: --gpu-hour-usd needs --gpus")
    replay = ReplayConfig(
        mode="closed" if args.concurrency else "open", speedup=args.speedup, concurrency=args.concurrency or 16,
        duration_s=args.duration, drain_timeout_s=args.drain_timeout, progress=not args.no_progress)
    slo = Slo(args.slo_ttft, args.slo_tpot) if args.slo_ttft or args.slo_tpot else None
    cost = CostModel(args.gpus, args.gpu_hour_usd) if args.gpus else None
    return BenchConfig(
        url=args.url, trace=args.trace, out=args.out, protocol=args.protocol, model=args.model, api_key=args.api_key,
        replay=replay, max_requests=args.max_requests, slo=slo, cost=cost, tokenizer=args.tokenizer,
        max_connections=args.max_connections, request_timeout_s=args.request_timeout, ignore_eos=args.ignore_eos,
        hit_window_s=args.hit_window, plots=not args.no_plots, percentiles=args.percentiles or PERCENTILES,
        tool_calls=args.tool_calls)


def _sweep(config: BenchConfig, args: argparse.Namespace) -> dict[str, Any]:
    """A sweep; a policy sweep switches the gateway's policy per point and restores it after."""
    from deepinfer_gateway.loadgen.sweep import GatewayRouting, run_sweep

    values = [v.strip() for v in args.sweep_values.split(",") if v.strip()]
    if args.sweep != "policy":
        return run_sweep(config, args.sweep, values)
    routing = GatewayRouting(args.url, args.admin_key or args.api_key)
    original = routing.get()["policy"]
    try:
        return run_sweep(config, "policy", values, configure_policy=routing.set)
    finally:
        routing.set(original)


def main(args: argparse.Namespace) -> int:
    if args.bench_command == "report":
        from deepinfer_gateway.loadgen.report import load_summaries, table

        print(table(load_summaries(args.dirs), markdown=args.markdown))
        return 0
    from deepinfer_gateway.loadgen.run import TargetUnreachable, run_bench
    from deepinfer_gateway.loadgen.sweep import SweepError
    from deepinfer_gateway.workload.trace_sources import TraceFetchError
    from deepinfer_gateway.workload.traces import TraceFormatError

    config = _config(args)
    if args.sweep and not args.sweep_values:
        raise SystemExit("bench: --sweep needs --sweep-values")
    try:
        result = _sweep(config, args) if args.sweep else run_bench(config)
    except (TargetUnreachable, SweepError, TraceFetchError, TraceFormatError) as exc:
        raise SystemExit(f"bench: {exc}") from None
    sys.stdout.write(json.dumps(result, separators=(",", ":")) + "\n")
    return 0
