"""Offline cluster simulator: the live gateway's routing, KV index and sim engine in virtual time.

    from deepinfer_gateway.simulate import load_cluster, run_simulation
    records, summary = run_simulation(load_cluster("bench/clusters/demo-pd.toml"), "trace.jsonl.gz")

Modules: config (the cluster TOML), tokens (synthetic token ids per trace block),
cluster (a simulated worker: SchedulerCore + the gateway's view of it), simulator (the
discrete-event loop and the engine side), gateway (routing on arrival and at the hand-off),
preparation (the gateway's per-request preparation time), stats (what a run counts),
sessions (closed-loop session rounds released as their dependencies finish),
run (trace -> records + summary.json), command (the CLI).
Design and validation: docs/simulate.md.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from deepinfer_gateway.simulate.config import ClusterConfig, load_cluster
    from deepinfer_gateway.simulate.run import run_simulation

__all__ = ["ClusterConfig", "load_cluster", "run_simulation"]

# Exported lazily: the CLI imports simulate.command on every start (its argument
# definitions), and the simulator's modules cost ~0.4 s of imports nobody else needs.
_EXPORTS = {"ClusterConfig": "config", "load_cluster": "config", "run_simulation": "run"}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
