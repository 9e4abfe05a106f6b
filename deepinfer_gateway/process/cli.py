"""`deepinfer-gateway` console script: demo, serve, worker, sim-cluster, bench, simulate, warm-cache.

Argument parsing, help text and dispatch only; the commands themselves are in
`cli_commands.py`.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from collections.abc import Sequence
from typing import Any

from deepinfer_gateway.process import container_init
from deepinfer_gateway.process.cli_commands import (
    DEMO_TOPOLOGIES,
    cmd_bench,
    cmd_demo,
    cmd_epp,
    cmd_serve,
    cmd_sim_cluster,
    cmd_simulate,
    cmd_warm_cache,
    cmd_worker,
)
from deepinfer_gateway.process.gateway_process import configure_logging


def worker_url(text: str) -> dict[str, str]:
    """`ROLE:HARDWARE@URL`, `ROLE@URL` or `URL` -> a `workers` entry (argparse type)."""
    from pydantic import ValidationError

    from deepinfer_gateway.config import parse_worker_spec

    spec, at, url = text.partition("@")
    if not at or "://" in spec:  # no ROLE:HARDWARE prefix; an @ is the URL's own
        spec, url = "", text
    role, _, hardware = spec.partition(":")
    entry = {"url": url, **({"role": role} if role else {}), **({"hardware": hardware} if hardware else {})}
    try:
        parse_worker_spec(entry)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(part) for part in first["loc"][1:]) or "worker"  # loc[0]: the engine tag
        raise argparse.ArgumentTypeError(f"{text!r}: {where}: {first['msg'].removeprefix('Value error, ')}"
                                         " (expected ROLE:HARDWARE@URL, e.g. prefill:sm100@http://10.0.0.5:8100)"
                                         ) from None
    return entry


def processes(text: str) -> int | str:
    """`--processes N|auto` (argparse type): a count, or "auto" (0 too) for one per CPU."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        count = int(text)
    except ValueError:
        count = -1
    if count < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number of processes or auto")
    return count


def _add_otel_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--otel-exporter", choices=["otlp", "console"], default=None,
                        help="OpenTelemetry server spans for generate/abort, continuing the gateway's trace "
                             "(default: off)")
    parser.add_argument("--otel-endpoint", default=None,
                        help="OTLP/HTTP traces endpoint (default: the OTEL_* environment's)")


LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def _add_logging_arguments(parser: argparse.ArgumentParser, *, top_level: bool) -> None:
    """On the top-level parser with their defaults; on each command with none, so a flag
    after the command overrides one before it and an absent one leaves it alone."""
    level = os.environ.get("DGW_LOG_LEVEL", "info").lower()
    fmt = os.environ.get("DGW_LOG_FORMAT")
    parser.add_argument("--log-level", type=str.lower, choices=LOG_LEVELS,
                        default=level if top_level else argparse.SUPPRESS,
                        help=f"log threshold (default: {level}; env DGW_LOG_LEVEL)")
    parser.add_argument("--log-format", choices=["text", "json"], default=fmt if top_level else argparse.SUPPRESS,
                        help="json: one JSON object per line with request_id "
                             f"(default: {fmt or 'log_format of the settings, else text'}; env DGW_LOG_FORMAT)")


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Descriptions keep their line breaks; a flag's help ends with its default, unless the
    help says it already or there is none to say (None: the help explains what happens)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "(default" in text or action.default is None or action.required or not action.option_strings:
            return text
        return super()._get_help_string(action)


class CommandParser(argparse.ArgumentParser):
    """Every parser, the commands' included (add_subparsers makes its own class), gets the formatter."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)


DESCRIPTION = """\
DeepInfer Gateway: an OpenAI- and Anthropic-compatible HTTP endpoint for DeepSeek-V4.1
engine workers, with KV-cache-aware routing and prefill/decode disaggregation.

Try it with `demo` (a gateway and a simulated cluster on this machine, no GPU needed);
put `serve` in front of real workers; `deepinfer-gateway COMMAND --help` for a command's
options. --log-level and --log-format go before or after the command."""

EPILOG = """\
examples:
  deepinfer-gateway demo                        # http://127.0.0.1:8000/v1, 6 simulated workers
  deepinfer-gateway serve --config gateway.toml
  deepinfer-gateway serve --config gateway.toml --processes auto   # one gateway process per CPU
  deepinfer-gateway serve --worker-url prefill:sm100@http://10.0.0.5:8100 \\
      --worker-url decode:sm100@http://10.0.0.6:8100 --api-key "$KEY" --log-level debug
  deepinfer-gateway bench --url http://127.0.0.1:8000 --trace mooncake:conversation --out results/

settings (serve): flags > DGW_* environment > secrets directory > TOML file > defaults;
every setting, its default and its variable: docs/config.md"""

SERVE_DESCRIPTION = """\
Run the gateway in front of engine workers that are already running.

Settings come from, highest first: these flags, DGW_* environment variables (nested with
__, e.g. DGW_ROUTER__POLICY; lists as JSON), files in the secrets directory, the --config
TOML file, defaults (docs/config.md). --worker-url and --api-key replace the configured
workers and keys. A configuration error prints `config error: FIELD: REASON` and exits 2."""


def build_parser() -> argparse.ArgumentParser:
    from deepinfer_gateway.config.policies import POLICIES

    parser = CommandParser(prog="deepinfer-gateway", description=DESCRIPTION, epilog=EPILOG)
    _add_logging_arguments(parser, top_level=True)
    sub = parser.add_subparsers(dest="command", required=True, title="commands", metavar="COMMAND")

    def command(name: str, help: str, description: str | None = None) -> argparse.ArgumentParser:
        cmd = sub.add_parser(name, help=help, description=description or help[0].upper() + help[1:] + ".")
        _add_logging_arguments(cmd, top_level=False)
        return cmd

    demo = command("demo", "a gateway and a simulated SM100/Ascend cluster on this machine, no GPU needed")
    demo.add_argument("--host", default="127.0.0.1", help="gateway listen address")
    demo.add_argument("--port", type=int, default=8000, help="gateway listen port")
    demo.add_argument("--redis-url", default=None, help="share the prefix index through Redis (default: in memory)")
    demo.add_argument("--topology", choices=sorted(DEMO_TOPOLOGIES), default="pd",
                      help="pd: prefill and decode pools; unified: workers doing both")
    demo.add_argument("--worker-base-port", type=int, default=8100, help="first simulated worker's port")
    demo.add_argument("--time-scale", type=float, default=1.0, help="divide every simulated duration by this")
    demo.add_argument("--api-key", metavar="KEY", default=None,
                      help="the key clients must present (default: none on loopback, else a random one, printed)")
    demo.add_argument("--processes", metavar="N", type=processes, default=None,
                      help="gateway processes behind the port, or auto: one per CPU (default: 2 where more than "
                           "one CPU is available, else 1)")
    demo.set_defaults(func=cmd_demo)

    serve = command("serve", "the gateway in front of running workers (TOML config, DGW_* environment, flags)",
                    SERVE_DESCRIPTION)
    serve.add_argument("--config", metavar="FILE", default=None, help="TOML settings file (default: none)")
    serve.add_argument("--host", default=None, help="listen address (default: the settings', else 127.0.0.1)")
    serve.add_argument("--port", type=int, default=None, help="listen port (default: the settings', else 8000)")
    serve.add_argument("--redis-url", default=None,
                       help="Redis shared by gateway replicas (default: the settings', else this process's memory)")
    serve.add_argument("--worker-url", metavar="ROLE:HARDWARE@URL", type=worker_url, action="append", default=None,
                       help="a worker, repeatable; ROLE unified|prefill|decode, HARDWARE sm100|ascend950, both "
                            "optional, e.g. prefill:sm100@http://10.0.0.5:8100 (default: the settings' workers)")
    serve.add_argument("--policy", metavar="NAME", choices=sorted(POLICIES), default=None,
                       help=f"routing policy of prefill and unified pools: {', '.join(sorted(POLICIES))} "
                            "(default: the settings', else estimated_ttft)")
    serve.add_argument("--api-key", metavar="KEY", action="append", default=None,
                       help="accept this key, repeatable; kept only as its SHA-256, no admin rights "
                            "(default: the settings' api_keys; none at all: authentication off, refused beyond "
                            "loopback unless --allow-unauthenticated)")
    serve.add_argument("--allow-unauthenticated", action="store_true",
                       help="serve without API keys on an address beyond loopback (default: the settings' "
                            "allow_unauthenticated, else refused)")
    serve.add_argument("--processes", metavar="N", type=processes, default=None,
                       help="gateway processes sharing the port, or auto: one per CPU this process may use; above 1 "
                            "they share state through --redis-url, else a Redis server they start on a Unix socket "
                            "(default: the settings', else 1)")
    serve.add_argument("--secrets-dir", metavar="DIR", default=None,
                       help="directory of files named after settings, e.g. api_keys holding a JSON list of key "
                            "records (default: $DGW_SECRETS_DIR, else none)")
    serve.set_defaults(func=cmd_serve)

    epp = command("epp", "the router as an Envoy ext_proc Endpoint Picker (Gateway API Inference Extension)",
                  "The gateway's routing (same settings, prefix index, KV event feeders, planner, policies as "
                  "serve) behind an Envoy ext_proc gRPC server: Envoy (or any Gateway API Inference Extension "
                  "data plane) asks it which endpoint serves each request. Unified pools only. Every port binds "
                  "--grpc-host / --metrics-host, loopback unless told otherwise.")
    epp.add_argument("--config", metavar="FILE", default=None, help="TOML settings file, as serve's (default: none)")
    epp.add_argument("--redis-url", default=None, help="Redis shared with gateways and other EPP replicas "
                                                       "(default: the settings', else this process's memory)")
    epp.add_argument("--worker-url", metavar="ROLE:HARDWARE@URL", type=worker_url, action="append", default=None,
                     help="a worker, repeatable, as serve's; its URL's host:port is the endpoint the data plane "
                          "dials, so an IP address (default: the settings' workers)")
    epp.add_argument("--policy", metavar="NAME", choices=sorted(POLICIES), default=None,
                     help="routing policy (default: the settings', else estimated_ttft)")
    epp.add_argument("--grpc-host", default="127.0.0.1", help="ext_proc and health listen address")
    epp.add_argument("--grpc-port", type=int, default=9002, help="ext_proc port")
    epp.add_argument("--health-port", type=int, default=9003, help="gRPC health port (liveness, readiness)")
    epp.add_argument("--metrics-host", default="127.0.0.1", help="/metrics listen address")
    epp.add_argument("--metrics-port", type=int, default=9090, help="/metrics port")
    epp.add_argument("--fallbacks", type=int, default=2,
                     help="endpoints listed after the pick, for the data plane's retries (0: only the pick, "
                          "which Envoy's ORIGINAL_DST cluster needs)")
    epp.add_argument("--subset-hint-header", action="store_true",
                     help="also take the subset hint from the x-gateway-destination-endpoint-subset request header; "
                          "only where the data plane sets or strips that header, as clients can send it (default: "
                          "the envoy.lb.subset_hint metadata alone)")
    epp.add_argument("--secrets-dir", metavar="DIR", default=None,
                     help="directory of files named after settings, as serve's (default: $DGW_SECRETS_DIR, else none)")
    epp.set_defaults(func=cmd_epp)

    worker = command("worker", "one engine worker speaking worker protocols v1 and v2")
    worker.add_argument("--engine", choices=["sim", "deepinfer"], default="sim",
                        help="sim: calibrated simulation; deepinfer: the DeepInfer LLMEngine")
    worker.add_argument("--role", choices=["unified", "prefill", "decode"], default="unified",
                        help="what the worker does in a PD cluster")
    worker.add_argument("--hardware", choices=["sm100", "ascend950"], default="sm100",
                        help="hardware kind it reports (the sim engine's speed profile)")
    worker.add_argument("--host", default="127.0.0.1", help="listen address")
    worker.add_argument("--port", type=int, default=8100, help="listen port")
    worker.add_argument("--worker-id", default=None, help="id it reports (default: HARDWARE-ROLE-PORT)")
    worker.add_argument("--time-scale", type=float, default=1.0, help="sim engine: divide every duration by this")
    worker.add_argument("--profiles", default=None, help="hardware profile TOML (default: the packaged one)")
    worker.add_argument("--model", default=None,
                        help="deepinfer engine: model checkpoint directory (default: none; required by it)")
    worker.add_argument("--kv-store-dir", default=None,
                        help="deepinfer engine: shared KV store directory for PD hand-off (default: none)")
    _add_otel_arguments(worker)
    worker.set_defaults(func=cmd_worker)

    cluster = command("sim-cluster", "several sim workers in one process sharing one KV store")
    cluster.add_argument("--workers", required=True,
                         help="comma list of ROLE:HARDWARE, e.g. unified:sm100,unified:sm100,prefill:ascend950 "
                              "(required)")
    cluster.add_argument("--host", default="127.0.0.1", help="listen address of every worker")
    cluster.add_argument("--base-port", type=int, default=8100, help="first worker's port; the others follow")
    cluster.add_argument("--time-scale", type=float, default=1.0, help="divide every simulated duration by this")
    cluster.add_argument("--profiles", default=None, help="hardware profile TOML (default: the packaged one)")
    cluster.add_argument("--no-store", action="store_true", help="memory-only cluster: no shared KV store tier")
    cluster.add_argument("--memory-blocks", type=int, default=None,
                         help="per-worker memory tier capacity in blocks (default: the profile's)")
    _add_otel_arguments(cluster)
    cluster.set_defaults(func=cmd_sim_cluster)

    from deepinfer_gateway.loadgen.command import add_arguments as add_bench_arguments

    bench = command("bench", "replay a trace through the OpenAI/Anthropic SDK against a server; `bench report DIR...`")
    add_bench_arguments(bench)
    bench.set_defaults(func=cmd_bench)

    from deepinfer_gateway.simulate.command import add_arguments as add_simulate_arguments

    simulate = command("simulate", "offline discrete-event run of the real router on a simulated cluster")
    add_simulate_arguments(simulate)
    simulate.set_defaults(func=cmd_simulate)

    warm = command("warm-cache", "fill the start-up cache (DGW_CACHE_DIR) now, e.g. at image build")
    warm.add_argument("--tokenizer", default=None, help="tokenizer.json or its directory (default: the packaged one)")
    warm.set_defaults(func=cmd_warm_cache)
    return parser


def _interrupt(signum: int, frame: object) -> None:
    """SIGTERM stops like Ctrl-C, so `finally` blocks stop child processes."""
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    from deepinfer_gateway.config import ConfigError

    init_status = container_init.become_init_if_pid1()  # PID 1 in a container: the init, the command in a child
    if init_status is not None:
        return init_status
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.log_level not in LOG_LEVELS:  # from DGW_LOG_LEVEL, which argparse does not check
        parser.error(f"DGW_LOG_LEVEL: {args.log_level!r} is not one of {', '.join(LOG_LEVELS)}")
    configure_logging(args.log_level, args.log_format or "text")
    signal.signal(signal.SIGTERM, _interrupt)
    started = time.monotonic()
    try:
        return int(args.func(args))
    except ConfigError as e:
        for where, reason in e.problems:
            print(f"config error: {where}: {reason}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        logging.getLogger(__name__).info("stopped after %.0fs", time.monotonic() - started)
        return 0


if __name__ == "__main__":
    sys.exit(main())
