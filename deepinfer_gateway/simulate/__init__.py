"""Offline cluster simulator: the live gateway's routing, KV index and sim engine in virtual time.

    from deepinfer_gateway.simulate import load_cluster, run_simulation
    records, summary = run_simulation(load_cluster("bench/clusters/demo-pd.toml"), "trace.jsonl.gz")

Modules: config (the cluster TOML), tokens (synthetic token ids per trace block),
cluster (a simulated worker: SchedulerCore + the gateway's view of it), simulator (the
discrete-event loop), run (trace -> records + summary.json), command (the CLI).
Design and validation: docs/simulate.md.
"""

from deepinfer_gateway.simulate.config import ClusterConfig, load_cluster
from deepinfer_gateway.simulate.run import run_simulation

__all__ = ["ClusterConfig", "load_cluster", "run_simulation"]
