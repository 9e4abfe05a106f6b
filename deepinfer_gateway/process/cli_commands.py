"""The `deepinfer-gateway` commands: what each subcommand does once its arguments are parsed.

Each `cmd_*` takes the parsed `argparse.Namespace`, builds a validated settings object and
hands it to the module that does the work; `cli.py` holds the parsers and dispatch.
Imports are inside the functions so `--help` stays fast.
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import signal
import subprocess
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from deepinfer_gateway.config import GatewaySettings
    from deepinfer_gateway.core.worker_auth import SecretTokens


def run_gateway(settings: GatewaySettings, log_level: str, log_format: str) -> int:
    """One gateway process, or `settings.processes` of them under a supervisor; the exit status."""
    from deepinfer_gateway.core import tracing
    from deepinfer_gateway.process.gateway_bind import check_gateway_bind
    from deepinfer_gateway.process.gateway_process import gateway_app, serve_gateway
    from deepinfer_gateway.process.supervisor import Supervisor, resolve_processes

    check_gateway_bind(settings)
    processes = resolve_processes(settings.processes)
    if processes > 1:
        return Supervisor(settings, processes, log_level=log_level, log_format=log_format).run()
    tracing.configure(settings.tracing)
    try:
        serve_gateway(*gateway_app(settings), settings, log_level)
    finally:
        tracing.shutdown()
    return 0


def _check_worker_token(settings: GatewaySettings) -> None:
    """A worker token file that cannot be read is a config error now, not a failed start-up later."""
    from deepinfer_gateway.config import ConfigError
    from deepinfer_gateway.core.worker_auth import TokenError, tokens_from

    try:
        tokens_from(settings.worker_token, settings.worker_token_file)
    except TokenError as e:
        raise ConfigError([("worker_token_file" if settings.worker_token_file else "worker_token", str(e))]) from None


def cmd_serve(args: argparse.Namespace) -> int:
    from deepinfer_gateway.config import load_settings
    from deepinfer_gateway.gateway.serving.auth import hash_key
    from deepinfer_gateway.process.gateway_process import configure_logging

    api_keys = None
    if args.api_key:
        digests = [hash_key(key) for key in args.api_key]
        api_keys = [{"name": f"cli-{digest[:8]}", "key_sha256": digest} for digest in digests]
    overrides = {"host": args.host, "port": args.port, "redis": {"url": args.redis_url}, "workers": args.worker_url,
                 "api_keys": api_keys, "router": {"policy": args.policy}, "processes": args.processes,
                 "allow_unauthenticated": args.allow_unauthenticated or None}
    settings = load_settings(args.config, overrides, secrets_dir=args.secrets_dir)
    _check_worker_token(settings)
    if args.log_format is None and settings.log_format != "text":  # the config file asked for JSON logs
        configure_logging(args.log_level, settings.log_format)
    return run_gateway(settings, args.log_level, args.log_format or settings.log_format)


def cmd_epp(args: argparse.Namespace) -> int:
    from deepinfer_gateway.config import load_settings
    from deepinfer_gateway.epp.runtime import EppOptions, run_epp
    from deepinfer_gateway.process.gateway_process import configure_logging

    overrides = {"redis": {"url": args.redis_url}, "workers": args.worker_url, "router": {"policy": args.policy}}
    settings = load_settings(args.config, overrides, secrets_dir=args.secrets_dir)
    _check_worker_token(settings)
    if args.log_format is None and settings.log_format != "text":
        configure_logging(args.log_level, settings.log_format)
    options = EppOptions(grpc_host=args.grpc_host, grpc_port=args.grpc_port, health_port=args.health_port,
                         metrics_host=args.metrics_host, metrics_port=args.metrics_port, fallbacks=args.fallbacks,
                         subset_hint_header=args.subset_hint_header)
    return run_epp(settings, options)


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
    from deepinfer_gateway.config import ApiKey, DgwWorkerSpec, GatewaySettings, RedisSettings
    from deepinfer_gateway.core.protocol import DEFAULT_MODEL
    from deepinfer_gateway.core.worker_auth import is_loopback
    from deepinfer_gateway.gateway.serving.auth import hash_key

    specs = parse_worker_list(",".join(DEMO_TOPOLOGIES[args.topology]))
    ports = [args.worker_base_port + i for i in range(len(specs))]
    cluster_cmd = [sys.executable, "-m", "deepinfer_gateway", "--log-level", args.log_level,
                   "--log-format", args.log_format or "text", "sim-cluster",
                   "--workers", ",".join(DEMO_TOPOLOGIES[args.topology]),
                   "--base-port", str(args.worker_base_port), "--time-scale", str(args.time_scale)]
    token = secrets.token_urlsafe(24)  # this demo's gateway is the only caller its workers serve
    child = subprocess.Popen(cluster_cmd, start_new_session=True, env={**os.environ, "DGW_WORKER_TOKEN": token})

    def stop_child(*_: object) -> None:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGTERM)
            try:
                child.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(child.pid, signal.SIGKILL)

    workers = tuple(DgwWorkerSpec(url=f"http://127.0.0.1:{port}", role=role, hardware=hardware)
                    for (role, hardware), port in zip(specs, ports, strict=True))
    # Beyond loopback (the image's default command) the demo is keyed: a key of its own, printed below.
    api_key = args.api_key or (None if is_loopback(args.host) else secrets.token_urlsafe(24))
    api_keys = (ApiKey(name="demo", key_sha256=hash_key(api_key)),) if api_key else ()
    settings = GatewaySettings(host=args.host, port=args.port, workers=workers, redis=RedisSettings(url=args.redis_url),
                               processes=demo_processes(args.processes, args.redis_url), worker_token=token,
                               api_keys=api_keys)
    base = f"http://{args.host}:{args.port}/v1"
    print(
        f"\nDeepInfer Gateway demo: {len(workers)} simulated workers "
        f"({', '.join(DEMO_TOPOLOGIES[args.topology])}), OpenAI base URL {base}\n\n"
        "  from openai import OpenAI\n"
        f"  client = OpenAI(base_url=\"{base}\", api_key=\"{api_key or 'demo'}\")\n"
        f"  print(client.chat.completions.create(model=\"{DEFAULT_MODEL}\", "
        "messages=[{\"role\": \"user\", \"content\": \"Hello!\"}]).choices[0].message.content)\n",
        flush=True,
    )
    try:
        return run_gateway(settings, args.log_level, args.log_format or "text")
    finally:
        stop_child()


DEMO_PROCESSES = 2  # enough to show the mode; a demo needs no more than one port's worth


def demo_processes(asked: int | Literal["auto"] | None, redis_url: str | None) -> int | Literal["auto"]:
    """`demo --processes`, else 2 where this process may use more than one CPU and the
    processes can share state (a Redis URL or a server binary to start), else 1."""
    if asked is not None:
        return asked
    from deepinfer_gateway.infra.redis_process import NoRedisServerBinary, redis_server_binary
    from deepinfer_gateway.process.supervisor import available_cpus

    if available_cpus() < 2:
        return 1
    if not redis_url:
        try:
            redis_server_binary()
        except NoRedisServerBinary as e:
            logging.getLogger(__name__).warning("demo: one gateway process (%s)", e)
            return 1
    return DEMO_PROCESSES


def cmd_sim_cluster(args: argparse.Namespace) -> int:
    import asyncio

    from deepinfer_gateway.core import tracing
    from deepinfer_gateway.core.protocol import Role
    from deepinfer_gateway.workers.sim.cluster import SimWorkerSpec, serve_sim_cluster

    specs = [
        SimWorkerSpec(f"{hardware}-{role}-{args.base_port + i}", Role(role), hardware, args.base_port + i,
                      args.time_scale, args.memory_blocks)
        for i, (role, hardware) in enumerate(parse_worker_list(args.workers))
    ]

    tokens = _worker_tokens(args.host)
    with_spans = _worker_spans(args)

    async def serve_until_stopped() -> None:
        cluster = await serve_sim_cluster(specs, args.host, with_store=not args.no_store,
                                          profiles_path=args.profiles, wrap=with_spans, tokens=tokens)
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
    from deepinfer_gateway.config import TracingSettings
    from deepinfer_gateway.core import tracing
    from deepinfer_gateway.core.protocol import HEALTH_PATH, INFO_PATH, KV_EVENTS_PATH, LOAD_PATH

    if args.otel_exporter is None:
        return lambda app: app
    tracing.configure(TracingSettings(enabled=True, exporter=args.otel_exporter, endpoint=args.otel_endpoint,
                                      service_name="deepinfer-worker"))
    polled = frozenset({HEALTH_PATH, INFO_PATH, KV_EVENTS_PATH, LOAD_PATH})
    return lambda app: tracing.ServerSpans(app, skip=polled)


def _worker_tokens(host: str) -> SecretTokens | None:
    """The worker token from DGW_WORKER_TOKEN(_FILE); refuses a tokenless worker beyond loopback."""
    from deepinfer_gateway.core.worker_auth import TokenError, check_bind, worker_tokens_from_env

    try:
        tokens = worker_tokens_from_env()
    except TokenError as e:
        raise SystemExit(str(e)) from None
    check_bind(host, tokens)
    return tokens


def cmd_worker(args: argparse.Namespace) -> int:
    from deepinfer_gateway.core import tracing
    from deepinfer_gateway.core.protocol import Role

    tokens = _worker_tokens(args.host)
    with_spans = _worker_spans(args)
    try:
        if args.engine == "deepinfer":
            from deepinfer_gateway.core.protocol import Hardware
            from deepinfer_gateway.infra.asgi import run_until_signal
            from deepinfer_gateway.workers.deepinfer.config import DeepInferConfig
            from deepinfer_gateway.workers.deepinfer.engine import build_deepinfer_engine
            from deepinfer_gateway.workers.server import create_worker_app

            if not args.model:
                raise SystemExit("--engine deepinfer needs --model CHECKPOINT_DIR")
            config = DeepInferConfig(model=args.model, role=Role(args.role), hardware=Hardware(args.hardware),
                                     worker_id=args.worker_id or f"{args.hardware}-{args.role}-{args.port}",
                                     kv_store_dir=args.kv_store_dir)
            run_until_signal(with_spans(create_worker_app(build_deepinfer_engine(config), tokens=tokens)),
                             args.host, args.port,
                             log_level=args.log_level)
            return 0
        from deepinfer_gateway.workers.sim.run import WorkerOptions, run_worker

        run_worker(WorkerOptions(role=Role(args.role), hardware=args.hardware, host=args.host, port=args.port,
                                 worker_id=args.worker_id, profiles_path=args.profiles, time_scale=args.time_scale,
                                 tokens=tokens),
                   wrap=with_spans)
        return 0
    finally:
        tracing.shutdown()


def cmd_bench(args: argparse.Namespace) -> int:
    from deepinfer_gateway.loadgen.command import main as bench_main

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
