"""A worker process serving the DeepInfer wrapper on the interface double, over real HTTP.

    python -m tests.deepinfer_double.serve --port 8101 --role unified --hardware sm100 [--mtp 3]

Installs the double as `deepinfer` in this process's `sys.modules`, switches it to
planner mode (the sim's deterministic OutputPlanner is its "model", so answers read like
a model's through the gateway), then:
- unified: runs the real CLI, `deepinfer-gateway worker --engine deepinfer` (cli.main ->
  cmd_worker -> build_deepinfer_engine -> create_worker_app under run_until_signal);
  the wrapper's lazy `import deepinfer` finds the double;
- prefill/decode: the same calls, plus the double's KV transfer adapter (the CLI passes
  none: no adapter works on real DeepInfer 0.1.0 yet, see workers/deepinfer/transfer.py).
`--mtp N` turns on DSpark-style multi-token steps (1 + N tokens per decode step).
Tests only: `start_workers` runs these for the `deepinfer_workers` fixture (tests/conftest.py),
behind the gateway in the protocol suites run on each engine and in tests/e2e/test_gateway_deepinfer_engine.py.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

MODEL_DIR = "/nonexistent/deepinfer-double-checkpoint"  # EngineArgs.model: the double loads nothing


@contextmanager
def start_workers(specs: Sequence[tuple[str, str, Sequence[str]]], env: dict[str, str] | None = None
                  ) -> Iterator[list[tuple[str, str, str]]]:
    """Worker processes for (role, hardware, extra flags), all started before waiting on any;
    yields their (url, role, hardware) once each listens, and stops them on exit. `env`: more
    environment (e.g. DGW_WORKER_TOKEN)."""
    from harness.launch import Proc, free_port, wait_for_port

    root = Path(__file__).resolve().parents[2]  # the checkout, so `tests` imports in the child
    procs: list[Proc] = []
    workers: list[tuple[str, str, str]] = []
    try:
        for role, hardware, extra in specs:
            port = free_port()
            procs.append(Proc([sys.executable, "-m", "tests.deepinfer_double.serve", "--port", str(port),
                               "--role", role, "--hardware", hardware, *extra],
                               env={"PYTHONPATH": str(root), **(env or {})}))
            workers.append((f"http://127.0.0.1:{port}", role, hardware))
        for url, _, _ in workers:
            wait_for_port(int(url.rsplit(":", 1)[1]), timeout=60)
        yield workers
    finally:
        for proc in procs:
            proc.stop()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.deepinfer_double.serve", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--role", choices=["unified", "prefill", "decode"], default="unified")
    parser.add_argument("--hardware", choices=["sm100", "ascend950"], default="sm100")
    parser.add_argument("--worker-id", default=None)
    parser.add_argument("--kv-store-dir", default=None)
    parser.add_argument("--mtp", type=int, default=0, help="draft tokens per decode step (0: one token a step)")
    parser.add_argument("--log-level", default="warning")
    args = parser.parse_args(argv)

    if args.mtp:
        os.environ["DEEPINFER_ENABLE_MTP_VARLEN"] = "1"
        os.environ["DEEPINFER_USE_NEXTN_DECODE"] = str(args.mtp)
    from tests.deepinfer_double import core, install_in_process

    install_in_process()
    core.enable_planner()

    worker_id = args.worker_id or f"{args.hardware}-{args.role}-{args.port}"
    if args.role == "unified":
        from deepinfer_gateway.process import cli

        cli_args = ["--log-level", args.log_level, "worker", "--engine", "deepinfer", "--model", MODEL_DIR,
                    "--role", args.role, "--hardware", args.hardware, "--host", args.host, "--port", str(args.port),
                    "--worker-id", worker_id]
        return cli.main(cli_args)

    from deepinfer_gateway.infra.asgi import run_until_signal
    from deepinfer_gateway.core.protocol import Hardware, Role
    from deepinfer_gateway.workers.deepinfer.config import DeepInferConfig
    from deepinfer_gateway.workers.deepinfer.engine import build_deepinfer_engine
    from deepinfer_gateway.workers.server import create_worker_app
    from tests.deepinfer_double import DoubleKvTransfer

    if not args.kv_store_dir:
        parser.error(f"--role {args.role} needs --kv-store-dir")
    config = DeepInferConfig(model=MODEL_DIR, role=Role(args.role), hardware=Hardware(args.hardware),
                             worker_id=worker_id, kv_store_dir=args.kv_store_dir)
    engine = build_deepinfer_engine(config, kv_transfer=DoubleKvTransfer())
    run_until_signal(create_worker_app(engine), args.host, args.port, log_level=args.log_level)
    return 0


if __name__ == "__main__":
    sys.exit(main())
