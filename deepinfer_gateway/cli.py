"""`deepinfer-gateway` console script: demo, serve, worker, sim-cluster, bench, simulate, warm-cache.

Argument parsing only; each command builds a validated settings object and hands it
to the module that does the work.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from deepinfer_gateway.config import GatewaySettings

DEFAULT_MODEL = "DeepSeek-V4.1-Flash"


def _configure_logging(level: str, fmt: str) -> None:
    from deepinfer_gateway.gateway.logs import configure_logging

    configure_logging(level, fmt)


def _run_gateway(settings: GatewaySettings, log_level: str) -> None:
    from deepinfer_gateway import tracing
    from deepinfer_gateway.asgi import run_until_signal
    from deepinfer_gateway.gateway.app import create_app
    from deepinfer_gateway.gateway.logs import RequestContext, current_request_id

    tracing.configure(settings.tracing)
    try:
        shutting_down = threading.Event()  # set by SIGTERM/SIGINT: /ready answers 503 from then on
        spans = tracing.ServerSpans(create_app(settings, shutting_down=shutting_down),
                                    request_id=lambda _scope: current_request_id())
        app = RequestContext(spans, access=settings.access_log)
        run_until_signal(app, settings.host, settings.port, log_level=log_level,
                         graceful_s=settings.shutdown_grace_s, drain_delay_s=settings.shutdown_delay_s,
                         on_signal=shutting_down.set)
    finally:
        tracing.shutdown()


def cmd_serve(args: argparse.Namespace) -> int:
    from deepinfer_gateway.config import load_settings

    settings = load_settings(args.config, {"host": args.host, "port": args.port, "redis_url": args.redis_url})
    if args.log_format is None and settings.log_format != "text":  # the config file asked for JSON logs
        _configure_logging(args.log_level, settings.log_format)
    _run_gateway(settings, args.log_level)
    return 0


DEMO_TOPOLOGIES = {
    "pd": ["prefill:sm100", "prefill:sm100", "prefill:ascend950", "decode:sm100", "decode:sm100", "decode:ascend950"],
    "unified": ["unified:sm100", "unified:sm100", "unified:ascend950"],
}


def parse_worker_list(text: str) -> list[tuple[str, str]]:
    """`unified:sm100,prefill:ascend950` -> [(role, hardware), ...]."""
    out = []
    for item in text.split(","):
        role, _, hardware = item.strip().partition(":")
        if role not in ("unified", "prefill", "decode") or hardware not in ("sm100", "ascend950"):
            raise SystemExit(f"bad worker {item!r}: expected ROLE:HARDWARE, e.g. prefill:sm100")
        out.append((role, hardware))
    return out


def cmd_demo(args: argparse.Namespace) -> int:
    from deepinfer_gateway.config import GatewaySettings, WorkerSpec

    specs = parse_worker_list(",".join(DEMO_TOPOLOGIES[args.topology]))
    ports = [args.worker_base_port + i for i in range(len(specs))]
    cluster_cmd = [sys.executable, "-m", "deepinfer_gateway.cli", "--log-level", args.log_level,
                   "--log-format", args.log_format or "text", "sim-cluster",
                   "--workers", ",".join(DEMO_TOPOLOGIES[args.topology]),
                   "--base-port", str(args.worker_base_port), "--time-scale", str(args.time_scale)]
    child = subprocess.Popen(cluster_cmd, start_new_session=True)

    def stop_child(*_: object) -> None:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGTERM)
            try:
                child.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(child.pid, signal.SIGKILL)

    workers = tuple(WorkerSpec(url=f"http://127.0.0.1:{port}", role=role, hardware=hardware)  # type: ignore[arg-type]
                    for (role, hardware), port in zip(specs, ports, strict=True))
    settings = GatewaySettings(host=args.host, port=args.port, workers=workers, redis_url=args.redis_url)
    base = f"http://{args.host}:{args.port}/v1"
    print(
        f"\nDeepInfer Gateway demo: {len(workers)} simulated workers "
        f"({', '.join(DEMO_TOPOLOGIES[args.topology])}), OpenAI base URL {base}\n\n"
        "  from openai import OpenAI\n"
        f"  client = OpenAI(base_url=\"{base}\", api_key=\"demo\")\n"
        f"  print(client.chat.completions.create(model=\"{DEFAULT_MODEL}\", "
        "messages=[{\"role\": \"user\", \"content\": \"Hello!\"}]).choices[0].message.content)\n",
        flush=True,
    )
    try:
        _run_gateway(settings, args.log_level)
    finally:
        stop_child()
    return 0


def cmd_sim_cluster(args: argparse.Namespace) -> int:
    import asyncio

    from deepinfer_gateway import tracing
    from deepinfer_gateway.protocol import Role
    from deepinfer_gateway.workers.cluster import SimWorkerSpec, serve_sim_cluster

    specs = [
        SimWorkerSpec(f"{hardware}-{role}-{args.base_port + i}", Role(role), hardware, args.base_port + i,
                      args.time_scale, args.memory_blocks)
        for i, (role, hardware) in enumerate(parse_worker_list(args.workers))
    ]

    with_spans = _worker_spans(args)

    async def serve_until_stopped() -> None:
        cluster = await serve_sim_cluster(specs, args.host, with_store=not args.no_store,
                                          profiles_path=args.profiles, wrap=with_spans)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            await stop.wait()
        finally:
            await cluster.stop()

    try:
        asyncio.run(serve_until_stopped())
    finally:
        tracing.shutdown()
    return 0


def _worker_spans(args: argparse.Namespace) -> Callable[[Any], Any]:
    """Tracing for a worker process (`--otel-exporter`): its app wrapped in server spans
    that continue the gateway's trace; the polled endpoints get none."""
    from deepinfer_gateway import tracing
    from deepinfer_gateway.config import TracingSettings
    from deepinfer_gateway.protocol import HEALTH_PATH, INFO_PATH, KV_EVENTS_PATH, LOAD_PATH

    if args.otel_exporter is None:
        return lambda app: app
    tracing.configure(TracingSettings(enabled=True, exporter=args.otel_exporter, endpoint=args.otel_endpoint,
                                      service_name="deepinfer-worker"))
    polled = frozenset({HEALTH_PATH, INFO_PATH, KV_EVENTS_PATH, LOAD_PATH})
    return lambda app: tracing.ServerSpans(app, skip=polled)


def cmd_worker(args: argparse.Namespace) -> int:
    from deepinfer_gateway import tracing
    from deepinfer_gateway.protocol import Role

    with_spans = _worker_spans(args)
    try:
        if args.engine == "deepinfer":
            from deepinfer_gateway.asgi import run_until_signal
            from deepinfer_gateway.protocol import Hardware
            from deepinfer_gateway.workers.deepinfer.config import DeepInferConfig
            from deepinfer_gateway.workers.deepinfer.engine import build_deepinfer_engine
            from deepinfer_gateway.workers.server import create_worker_app

            if not args.model:
                raise SystemExit("--engine deepinfer needs --model CHECKPOINT_DIR")
            config = DeepInferConfig(model=args.model, role=Role(args.role), hardware=Hardware(args.hardware),
                                     worker_id=args.worker_id or f"{args.hardware}-{args.role}-{args.port}",
                                     kv_store_dir=args.kv_store_dir)
            run_until_signal(with_spans(create_worker_app(build_deepinfer_engine(config))), args.host, args.port,
                             log_level=args.log_level)
            return 0
        from deepinfer_gateway.workers.run import WorkerOptions, run_worker

        run_worker(WorkerOptions(role=Role(args.role), hardware=args.hardware, host=args.host, port=args.port,
                                 worker_id=args.worker_id, profiles_path=args.profiles, time_scale=args.time_scale),
                   wrap=with_spans)
        return 0
    finally:
        tracing.shutdown()


def cmd_bench(args: argparse.Namespace) -> int:
    from deepinfer_gateway.bench.command import main as bench_main

    return bench_main(args)


def cmd_simulate(args: argparse.Namespace) -> int:
    from deepinfer_gateway.simulate.command import main as simulate_main

    return simulate_main(args)


def cmd_warm_cache(args: argparse.Namespace) -> int:
    from deepinfer_gateway.recipe_bridge.warm import warm_start_up_cache

    entries = warm_start_up_cache(args.tokenizer)
    if not entries:
        raise SystemExit("warm-cache: nothing could be written (is the cache directory writable? DGW_CACHE_DIR)")
    print(f"{len(entries)} entries in {entries[0].parent}")
    return 0


def _add_otel_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--otel-exporter", choices=["otlp", "console"], default=None,
                        help="OpenTelemetry server spans for generate/abort, continuing the gateway's trace (off)")
    parser.add_argument("--otel-endpoint", default=None, help="OTLP/HTTP traces endpoint (default: OTEL_* env)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deepinfer-gateway", description=__doc__)
    parser.add_argument("--log-level", default=os.environ.get("DGW_LOG_LEVEL", "info"))
    parser.add_argument("--log-format", choices=["text", "json"], default=os.environ.get("DGW_LOG_FORMAT"),
                        help="json: one JSON object per line with request_id (default text; env DGW_LOG_FORMAT)")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="gateway + a simulated SM100/Ascend cluster on embedded defaults")
    demo.add_argument("--host", default="127.0.0.1")
    demo.add_argument("--port", type=int, default=8000)
    demo.add_argument("--redis-url", default=None, help="share the prefix index through Redis")
    demo.add_argument("--topology", choices=sorted(DEMO_TOPOLOGIES), default="pd",
                      help="pd: prefill and decode pools (default); unified: workers doing both")
    demo.add_argument("--worker-base-port", type=int, default=8100)
    demo.add_argument("--time-scale", type=float, default=1.0, help="divide every simulated duration by this")
    demo.set_defaults(func=cmd_demo)

    serve = sub.add_parser("serve", help="the gateway alone (TOML config; DGW_* environment overrides)")
    serve.add_argument("--config", default=None)
    serve.add_argument("--host", default=None)
    serve.add_argument("--port", type=int, default=None)
    serve.add_argument("--redis-url", default=None)
    serve.set_defaults(func=cmd_serve)

    worker = sub.add_parser("worker", help="one engine worker speaking worker protocol v1")
    worker.add_argument("--engine", choices=["sim", "deepinfer"], default="sim")
    worker.add_argument("--role", choices=["unified", "prefill", "decode"], default="unified")
    worker.add_argument("--hardware", choices=["sm100", "ascend950"], default="sm100")
    worker.add_argument("--host", default="127.0.0.1")
    worker.add_argument("--port", type=int, default=8100)
    worker.add_argument("--worker-id", default=None)
    worker.add_argument("--time-scale", type=float, default=1.0)
    worker.add_argument("--profiles", default=None, help="hardware profile TOML (default: the packaged one)")
    worker.add_argument("--model", default=None, help="deepinfer engine: model checkpoint path")
    worker.add_argument("--kv-store-dir", default=None, help="deepinfer engine: shared KV store directory (PD)")
    _add_otel_arguments(worker)
    worker.set_defaults(func=cmd_worker)

    cluster = sub.add_parser("sim-cluster", help="several sim workers in one process sharing one KV store")
    cluster.add_argument("--workers", required=True, help="e.g. unified:sm100,unified:sm100,prefill:ascend950")
    cluster.add_argument("--host", default="127.0.0.1")
    cluster.add_argument("--base-port", type=int, default=8100)
    cluster.add_argument("--time-scale", type=float, default=1.0)
    cluster.add_argument("--profiles", default=None)
    cluster.add_argument("--no-store", action="store_true", help="memory-only cluster: no shared KV store tier")
    cluster.add_argument("--memory-blocks", type=int, default=None, help="per-worker memory tier capacity (blocks)")
    _add_otel_arguments(cluster)
    cluster.set_defaults(func=cmd_sim_cluster)

    from deepinfer_gateway.bench.command import add_arguments as add_bench_arguments

    bench = sub.add_parser("bench", help="replay a trace through the OpenAI/Anthropic SDK; `bench report DIR...`")
    add_bench_arguments(bench)
    bench.set_defaults(func=cmd_bench)

    from deepinfer_gateway.simulate.command import add_arguments as add_simulate_arguments

    simulate = sub.add_parser("simulate", help="offline discrete-event run of the real router on a simulated cluster")
    add_simulate_arguments(simulate)
    simulate.set_defaults(func=cmd_simulate)

    warm = sub.add_parser("warm-cache", help="fill the start-up cache (DGW_CACHE_DIR) now, e.g. at image build")
    warm.add_argument("--tokenizer", default=None, help="tokenizer.json or its directory (default: the packaged one)")
    warm.set_defaults(func=cmd_warm_cache)
    return parser


def _interrupt(signum: int, frame: object) -> None:
    """SIGTERM stops like Ctrl-C, so `finally` blocks stop child processes."""
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _configure_logging(args.log_level, args.log_format or "text")
    signal.signal(signal.SIGTERM, _interrupt)
    started = time.monotonic()
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        logging.getLogger(__name__).info("stopped after %.0fs", time.monotonic() - started)
        return 0


if __name__ == "__main__":
    sys.exit(main())
