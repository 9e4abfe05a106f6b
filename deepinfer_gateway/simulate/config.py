"""The simulated cluster: one frozen, validated object read from a TOML file.

```toml
model = "DeepSeek-V4.1-Flash"
profiles = ""                     # hardware profile TOML; "" = the packaged one
time_scale = 1.0                  # divide every engine duration by this (as `sim-cluster --time-scale`)
load_report_interval_s = 1.0      # the gateway's health interval: load reports lag by up to this
kv_events_interval_s = 0.05       # KV event feed poll interval: the prefix index lags by up to this

[store]                           # the shared KV store tier ("3FS")
enabled = true
capacity_blocks = 10_000_000
# read_bytes_per_s = 25e9         # override every profile's store read bandwidth

[gateway]                         # what the live gateway adds to each request (0 = ideal gateway)
request_overhead_s = 0.0          # arrival -> routing (parsing, HTTP)
per_prompt_token_s = 0.0          # tokenization + hashing, per prompt token
handoff_overhead_s = 0.0          # prefill finish -> decode worker gets the hand-off
serial = true                     # one event loop: requests are prepared one after another
relay_waits = true                # serial: a first token is relayed only once the event loop's
                                  # preparation backlog is done
# offload_tokens = 16000          # serial: prompts this long are prepared in a second lane
                                  # (the gateway's preparation thread)
jitter = 0.0                      # relative spread (lognormal sigma) of each request's preparation cost
seed = 0                          # of the jitter

[router]                          # deepinfer_gateway.config.RouterSettings, as in the gateway's TOML
policy = "estimated_ttft"

[flow_control]                    # deepinfer_gateway.config.FlowControlSettings (off by default)
enabled = false
# flex_every = 0                  # (top level) every Nth request flex; traces carry no tier

[session_capacity]                # deepinfer_gateway.config.SessionCapacitySettings (off by default)
enabled = false                   # session rounds (simulate --sessions) wait for room, as in the gateway

[[workers]]                       # one group of identical workers
role = "prefill"                  # unified | prefill | decode
hardware = "sm100"                # a profile name
count = 2
# pool = ""                       # "" = the role's default pool
# memory_capacity_blocks = 100000 # override the profile's memory tier
```
"""

from __future__ import annotations

import tomllib
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator

from deepinfer_gateway.config import FlowControlSettings, RouterSettings, SessionCapacitySettings
from deepinfer_gateway.core.protocol import DEFAULT_MODEL, Role


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class WorkerGroup(_Frozen):
    role: Role = Role.UNIFIED
    hardware: str = "sm100"  # profile name in the profiles file
    count: int = Field(1, ge=1)
    pool: str = ""  # "" = the role's default pool (as the gateway's WorkerSpec)
    memory_capacity_blocks: int | None = Field(None, ge=1)


class StoreSettings(_Frozen):
    enabled: bool = True
    capacity_blocks: int = Field(10_000_000, ge=1)
    read_bytes_per_s: float | None = Field(None, gt=0)  # None: each profile's own


class GatewayCost(_Frozen):
    """Time the live gateway spends per request before routing it (0: an ideal gateway).

    A request costs `request_overhead_s + per_prompt_token_s * prompt tokens` (parse,
    template, tokenize, hash). With `serial`, requests are served one at a time in
    arrival order, as one gateway process's event loop does (a burst of long prompts
    queues behind itself); otherwise each request pays only its own cost.
    `simulate.calibrate.measure_gateway_cost()` measures the first two on this machine.

    `offload_tokens` (with `serial`): prompts of at least this many tokens (with the
    template) are prepared in a second lane, the live gateway's one preparation thread
    (bodies over `recipe_bridge.prepare.OFFLOAD_BODY_BYTES`), in parallel with the event
    loop's lane of smaller prompts; each lane is serial. None: one lane for all.

    `relay_waits` (with `serial`): a first token the engine produces while the event loop is
    busy preparing (its lane's backlog) reaches the client only when that backlog is done.
    Preparations in the thread lane do not hold it: with one preparation thread and a 0.5 ms
    GIL switch interval, the gateway adds ~1-4 ms to other streams' first tokens and gaps
    while big prompts are prepared (bench/relay_under_prep.py); before (several threads,
    5 ms interval) the relay was starved (240 ms median, docs/simulate.md). `jitter` draws
    each request's cost times a lognormal factor (sigma `jitter`, seeded by `seed`): the live
    gateway's cost is not a constant, and one deterministic replay of a burst-heavy trace can
    land on either side of a routing tie; an ensemble over seeds gives the expected figure.
    """

    request_overhead_s: float = Field(0.0, ge=0)
    per_prompt_token_s: float = Field(0.0, ge=0)
    handoff_overhead_s: float = Field(0.0, ge=0)  # prefill finish -> decode worker has the hand-off
    serial: bool = True
    relay_waits: bool = True
    offload_tokens: int | None = Field(None, ge=1)
    jitter: float = Field(0.0, ge=0)
    seed: int = 0


class ClusterConfig(_Frozen):
    name: str = "cluster"
    model: str = DEFAULT_MODEL
    profiles: str = ""
    time_scale: float = Field(1.0, gt=0)
    load_report_interval_s: float = Field(1.0, gt=0)
    kv_events_interval_s: float = Field(0.05, gt=0)
    kv_events_limit: int = Field(10_000, ge=1)
    store: StoreSettings = StoreSettings()
    gateway: GatewayCost = GatewayCost()
    router: RouterSettings = RouterSettings()
    # The gateway's flow control (router/flow.py) in virtual time; `flex_every` N > 0 sends every
    # Nth request of the trace as a flex request of a tenant of its own (traces carry no tier).
    flow_control: FlowControlSettings = FlowControlSettings()
    flex_every: int = Field(0, ge=0)
    # Sessions under cache pressure (router/session_capacity.py) in virtual time; session rounds only.
    session_capacity: SessionCapacitySettings = SessionCapacitySettings()
    workers: tuple[WorkerGroup, ...] = Field(min_length=1)

    @model_validator(mode="after")
    def _servable(self) -> ClusterConfig:
        roles = {g.role for g in self.workers}
        if Role.UNIFIED not in roles and not {Role.PREFILL, Role.DECODE} <= roles:
            raise ValueError("workers: need unified workers, or both prefill and decode workers")
        return self

    @property
    def worker_count(self) -> int:
        return sum(g.count for g in self.workers)


def load_cluster(path: str | Path) -> ClusterConfig:
    path = Path(path)
    with open(path, "rb") as f:
        data = tomllib.load(f)
    data.setdefault("name", path.stem)
    profiles = data.get("profiles")
    if profiles and not Path(profiles).is_absolute():  # relative to the cluster file
        data["profiles"] = str((path.parent / profiles).resolve())
    return ClusterConfig.model_validate(data)
