"""The `simulate` subcommand: argument definitions and dispatch (cli.py stays a thin table)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from deepinfer_gateway.config.policies import PolicyVariant, parse_policy


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", required=True,
                        help="trace file (Mooncake .jsonl[.gz], Azure .csv, a session trace: TraceLab CSV/JSONL, "
                             "Dynamo agentic JSONL) or synthetic:chat|agent[:k=v,...] (synthetic:agent:loop=closed,"
                             "...: closed-loop sessions) (required)")
    parser.add_argument("--cluster", required=True, type=Path, help="cluster TOML, see bench/clusters/ (required)")
    parser.add_argument("--out", type=Path, default=None,
                        help="write results.jsonl and summary.json here (default: summary on stdout only)")
    parser.add_argument("--speedup", type=float, default=1.0, help="arrivals at trace time / SPEEDUP")
    parser.add_argument("--max-requests", type=int, default=None, help="first N trace requests (default: all)")
    parser.add_argument("--policy", type=policy_argument, default=None,
                        help="routing policy instead of the cluster file's: a name, or a JSON table with its "
                             "parameters, e.g. '{\"name\": \"cache_aware\", \"min_match\": 0.2}' "
                             "(default: the file's)")
    parser.add_argument("--slo-ttft", type=float, default=None,
                        help="time-to-first-token goal for goodput, seconds (default: none)")
    parser.add_argument("--slo-tpot", type=float, default=None,
                        help="time-per-output-token goal for goodput, seconds (default: none)")
    parser.add_argument("--gpu-hour-usd", type=float, default=None,
                        help="price of a GPU hour for cost per million tokens (default: no cost)")
    parser.add_argument("--concurrency", type=int, default=None,
                        help="session workloads: N live sessions, a new one as one ends (default: the sessions' "
                             "arrival times)")
    parser.add_argument("--no-header-offset", action="store_true",
                        help="trace block 0 at prompt position 0 (default: after the chat template's 28 tokens)")


def policy_argument(text: str) -> PolicyVariant:
    """`--policy`: a policy name or a JSON table, validated before anything runs (argparse type)."""
    try:
        given = json.loads(text) if text.lstrip().startswith("{") else text
        return parse_policy(given)
    except ValueError as e:  # json.JSONDecodeError is one
        raise argparse.ArgumentTypeError(str(e)) from None


def main(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from deepinfer_gateway.simulate.config import load_cluster
    from deepinfer_gateway.simulate.run import run_simulation
    from deepinfer_gateway.workload.summary import Slo
    from deepinfer_gateway.workload.traces import TraceFormatError

    try:
        config = load_cluster(args.cluster)
    except (OSError, ValueError, ValidationError) as exc:
        raise SystemExit(f"simulate: cluster file {args.cluster}: {exc}") from None
    if args.policy:
        config = config.model_copy(update={"router": config.router.with_policies(args.policy)})
    slo = Slo(args.slo_ttft, args.slo_tpot) if args.slo_ttft or args.slo_tpot else None
    try:
        _, summary = run_simulation(config, args.trace, speedup=args.speedup, max_requests=args.max_requests,
                                    slo=slo, gpu_hour_usd=args.gpu_hour_usd,
                                    header_offset=not args.no_header_offset, out=args.out,
                                    concurrency=args.concurrency)
    except (TraceFormatError, ValueError) as exc:
        raise SystemExit(f"simulate: {exc}") from None
    sys.stdout.write(json.dumps(summary, separators=(",", ":")) + "\n")
    return 0
