"""Overload without collapse: goodput of each router when demand passes the cluster's capacity.

    python bench/overload.py [--targets gateway-flow,gateway,sglang-router,vllm-router]
                             [--workers 2] [--alone-s 30] [--flood-s 60] [--repeats 3]
                             [--flood-x 2.5] [--interactive-x 0.25] [--agent-sessions 2]

The cluster: `--workers` sim workers (one process, `sim-cluster`) with a small flat profile
(`max_num_seqs` sequences per worker, `--decode-tps` tokens/s per sequence, prefill at
20k tokens/s), so a few requests per second saturate it on a shared machine. Its capacity
is estimated as workers x max_num_seqs / (output tokens / decode tps) requests per second.

Tenants (each its own API key; the peers ignore keys):
- interactive: chat requests at `--interactive-x` x capacity (Poisson arrivals), tier default;
- agent: `--agent-sessions` sessions, each a closed loop of turns whose prompt grows by the
  previous answer, tier default;
- batch: `--flood-x` x capacity (Poisson), tier flex (the key's `service_tier`: nothing in the
  body, so the same requests go to every target).

Each target gets a fresh cluster and router; the interactive and agent tenants run alone
(`--alone-s`), then with the batch flood (`--flood-s`). Targets: `gateway-flow` (the gateway
with `[flow_control]` on, flex holding at most `--flex-share` of the slots and yielding the
tiers above their peak over `--flex-yield-ms`), `gateway-flow-noslots` (the same with no cap
on flex's slots), `gateway-flow-preempt` (gateway-flow on engines that schedule by priority and
preempt, profile `scheduling_policy = "priority"`: the gateway sends each request its tier as the
engine's priority and drops the slot caps there; the other targets' engines are first come,
first served, and none of them sends a priority), `gateway` (no flow control: every
request into the engines' queues), `sglang-router` and `vllm-router` (bench/peers.py's pinned peers, installed into
cached venvs on first use; `--no-peers` skips them). `--repeats N` interleaves N repetitions
and every figure is the median over them.

Per target and tenant: TTFT p50/p99 (s), goodput (requests/s over the phase, its drain
included, whose TTFT and time per output token met the tenant's targets:
`--interactive-ttft-s`, `--agent-ttft-s`, `--flex-ttft-s`; TPOT at most 2x the profile's),
shed rate (429 before any token), lost (neither served nor refused with 429: errors, broken
streams, timeouts); per phase the hit rate (cached / prompt tokens, from the answers' usage).
The last line is one JSON object: the rows, and for `gateway-flow`
`interactive_ttft_p99_flood_vs_alone`, `interactive_goodput_flood_vs_alone` (per offered
request: the phases draw their own arrivals),
`goodput_vs_best_peer` (cluster goodput under the flood over the best of sglang-router and
vllm-router; null when neither ran), `interactive_ttft_p99_flood_vs_noslots` and `goodput_vs_noslots`
(against `gateway-flow-noslots`), `goodput_vs_no_flow_control`, `hit_rate_vs_no_flow_control`, `shed_non_flex`
(interactive and agent requests refused under the flood) and `lost`; `flow_targets`: the headline
ratios (p99 flood/alone, interactive goodput flood/alone, goodput vs the best peer, shed_non_flex,
lost) of each `gateway-flow*` target run.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import random
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sibling bench scripts
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # harness/, at the repository root

from peers import Router, start_router

from deepinfer_gateway.core.protocol import DEFAULT_MODEL
from harness.launch import Gateway, SimCluster

PREFILL_TPS = 20_000.0
KEYS = {"interactive": ("sk-interactive", "default"), "agent": ("sk-agent", "default"), "batch": ("sk-batch", "flex")}
PEERS = ("sglang-router", "vllm-router")


def profile(decode_tps: float, max_num_seqs: int, scheduling_policy: str = "fcfs") -> str:
    return f"""[sm100]
hardware = "sm100"
kv_format = "v4.1-flash/sm100-fp8"
prefill_points = [[4096, {PREFILL_TPS}]]
decode_points = [[1, {decode_tps}], [512, {decode_tps}]]
gpus_per_instance = 1
dp_ranks = 1
max_num_seqs = {max_num_seqs}
max_num_batched_tokens = 8192
nextn = 0
scheduling_policy = "{scheduling_policy}"
"""


def keys_toml(tiers: bool) -> str:
    """The tenants' keys; with `tiers` each carries its service tier (a tier needs flow control on)."""
    return "".join(f'[[api_keys]]\nname = "{name}"\nkey_sha256 = "{hashlib.sha256(key.encode()).hexdigest()}"\n'
                   + (f'service_tier = "{tier}"\n' if tiers else "") for name, (key, tier) in KEYS.items())


@dataclass
class Spec:
    workers: int
    decode_tps: float
    max_num_seqs: int
    output_tokens: int
    alone_s: float
    flood_s: float
    flood_x: float
    interactive_x: float
    agent_sessions: int
    targets_s: dict[str, float]
    seed: int
    flex_share: float = 1.0
    flex_yield_ms: float = 10_000.0
    batch_output_tokens: int = 0  # the batch tenant's answers (0: output_tokens)

    @property
    def capacity_rps(self) -> float:
        return self.workers * self.max_num_seqs / (self.output_tokens / self.decode_tps)

    @property
    def tpot_target_s(self) -> float:
        return 2.0 / self.decode_tps


class Cluster:
    """The sim cluster, with what peers.start_router needs of it (`urls`, `gateway`)."""

    def __init__(self, spec: Spec, tmp: Path, flow: bool, slots: bool = False, preempts: bool = False) -> None:
        path = tmp / "profiles.toml"
        path.write_text(profile(spec.decode_tps, spec.max_num_seqs, "priority" if preempts else "fcfs"))
        self._cluster = SimCluster(",".join(["unified:sm100"] * spec.workers), time_scale=1.0,
                                   extra=["--no-store", "--profiles", str(path)])
        self.urls = self._cluster.urls
        flex_ms = spec.targets_s["batch"] * 1000
        self._toml = (f"[router.hardware.sm100]\nprefill_tokens_per_s = {PREFILL_TPS}\nkv_load_bytes_per_s = 25e9\n"
                      + (f"[flow_control]\nenabled = true\nmax_engine_wait_ms = 100\nmax_engine_waiting = 1\n"
                         f"default_ttft_ms = {spec.targets_s['interactive'] * 1000}\nflex_ttft_ms = {flex_ms}\n"
                         + (f"flex_max_share = {spec.flex_share}\nflex_yield_window_ms = {spec.flex_yield_ms}\n"
                            if slots else "")
                         if flow else "")
                      + keys_toml(tiers=flow))

    def gateway(self, tmp: Path, extra_toml: str = "", env: dict[str, str] | None = None) -> Gateway:
        return Gateway(tmp, [(url, "unified", "sm100") for url in self.urls], extra_toml=extra_toml + self._toml,
                       env=env, health_interval_s=1.0)

    def close(self) -> None:
        self._cluster.stop()


@dataclass
class Outcome:
    tenant: str
    status: int  # 200 served, 429 refused before any token, 0 lost
    ttft_s: float = 0.0
    tpot_s: float = 0.0
    sent_at: float = 0.0
    answer: str = ""
    prompt_tokens: int = 0  # the answer's usage
    cached_tokens: int = 0


@dataclass
class Phase:
    outcomes: list[Outcome] = field(default_factory=list)
    seconds: float = 0.0  # from the first arrival to the last answer (requests sent late are still served)
    send_lags: list[float] = field(default_factory=list)  # how late the client sent scheduled arrivals


async def one(http: httpx.AsyncClient, tenant: str, messages: list[dict[str, str]], max_tokens: int) -> Outcome:
    body = {"model": DEFAULT_MODEL, "messages": messages, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    outcome = Outcome(tenant, 0, sent_at=started)
    first = last = 0.0
    chunks, text = 0, []
    try:
        async with http.stream("POST", "/v1/chat/completions", content=orjson.dumps(body),
                               headers={"authorization": f"Bearer {KEYS[tenant][0]}",
                                        "content-type": "application/json"}) as response:
            if response.status_code == 429:
                outcome.status = 429
                return outcome
            if response.status_code != 200:
                return outcome
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = orjson.loads(line[6:])
                if "error" in chunk:
                    return outcome
                usage = chunk.get("usage")
                if usage:
                    outcome.prompt_tokens = usage.get("prompt_tokens") or 0
                    outcome.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                delta = (chunk.get("choices") or [{}])[0].get("delta") or {}
                content = delta.get("content") or delta.get("reasoning_content")
                if content:
                    now = time.perf_counter()
                    first = first or now
                    last = now
                    chunks += 1
                    text.append(content)
    except (httpx.HTTPError, OSError):
        return outcome
    if not first:
        return outcome
    outcome.status = 200
    outcome.ttft_s = first - started
    outcome.tpot_s = (last - first) / max(1, chunks - 1)
    outcome.answer = "".join(text)
    return outcome


async def poisson(http: httpx.AsyncClient, tenant: str, rate: float, seconds: float, spec: Spec,
                  rng: random.Random, phase: Phase, tasks: list[asyncio.Task[None]]) -> None:
    """Arrivals drawn up front (seeded), each sent at its time however late the client runs:
    every target gets the same number of requests; `send_lag_p99_s` says how late they went."""
    schedule, at = [], rng.expovariate(rate)
    while at < seconds:
        schedule.append(at)
        at += rng.expovariate(rate)
    start = time.perf_counter()
    for n, offset in enumerate(schedule):
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        else:
            phase.send_lags.append(-delay)
        prompt = f"{tenant} request {n} {rng.random()}: " + "summarise the state of flow control " * 12

        async def send(prompt: str = prompt) -> None:
            max_tokens = (spec.batch_output_tokens or spec.output_tokens) if tenant == "batch" else spec.output_tokens
            phase.outcomes.append(await one(http, tenant, [{"role": "user", "content": prompt}], max_tokens))

        tasks.append(asyncio.create_task(send()))


async def agent(http: httpx.AsyncClient, session: int, until: float, spec: Spec, phase: Phase) -> None:
    messages = [{"role": "system", "content": f"agent {session}: you call tools " * 30}]
    turn = 0
    while time.perf_counter() < until:
        turn += 1
        messages.append({"role": "user", "content": f"tool result {turn}: " + "ok " * 40})
        outcome = await one(http, "agent", messages, spec.output_tokens)
        phase.outcomes.append(outcome)
        if outcome.status == 200:
            messages.append({"role": "assistant", "content": outcome.answer})
        else:
            await asyncio.sleep(1.0)  # refused: back off as a client would
        await asyncio.sleep(0.2)  # the tool runs


async def run_phase(url: str, spec: Spec, seconds: float, flood: bool, rng: random.Random) -> Phase:
    phase = Phase()
    limits = httpx.Limits(max_connections=2000, max_keepalive_connections=2000)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(300.0), limits=limits) as http:
        until = time.perf_counter() + seconds
        tasks: list[asyncio.Task[None]] = []
        drivers = [poisson(http, "interactive", spec.interactive_x * spec.capacity_rps, seconds, spec, rng, phase,
                           tasks)]
        drivers += [agent(http, s, until, spec, phase) for s in range(spec.agent_sessions)]
        if flood:
            drivers.append(poisson(http, "batch", spec.flood_x * spec.capacity_rps, seconds, spec, rng, phase, tasks))
        started = time.perf_counter()
        await asyncio.gather(*drivers)
        if tasks:
            await asyncio.gather(*tasks)
        phase.seconds = time.perf_counter() - started
    return phase


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def figures(phase: Phase, spec: Spec, window_s: float) -> dict[str, Any]:
    """Per tenant: goodput over the arrival window (`window_s`); the cluster's over the phase's
    whole time, the flood's drain included (its late answers are served then)."""
    seconds = phase.seconds
    out: dict[str, Any] = {"seconds": round(seconds, 1)}
    good_total = 0
    for tenant in KEYS:
        mine = [o for o in phase.outcomes if o.tenant == tenant]
        if not mine:
            continue
        served = [o for o in mine if o.status == 200]
        good = [o for o in served if o.ttft_s <= spec.targets_s[tenant] and o.tpot_s <= spec.tpot_target_s]
        good_total += len(good)
        ttfts = [o.ttft_s for o in served]
        out[tenant] = {"requests": len(mine), "ttft_p50_s": pct(ttfts, 0.5), "ttft_p99_s": pct(ttfts, 0.99),
                       "goodput_rps": round(len(good) / window_s, 3),
                       "good_share": round(len(good) / len(mine), 4),
                       "shed_rate": round(sum(o.status == 429 for o in mine) / len(mine), 4),
                       "shed": sum(o.status == 429 for o in mine), "lost": sum(o.status == 0 for o in mine)}
    prompts = sum(o.prompt_tokens for o in phase.outcomes)
    out["hit_rate"] = round(sum(o.cached_tokens for o in phase.outcomes) / prompts, 4) if prompts else None
    out["goodput_rps"] = round(good_total / seconds, 3)
    out["send_lag_p99_s"] = pct(phase.send_lags, 0.99) or 0.0  # over ~0.1 s the client limited the run
    out["lost"] = sum(o.status == 0 for o in phase.outcomes)
    return out


def run_target(target: str, spec: Spec, repetition: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix=f"overload-{target}-") as tmp_dir:
        tmp = Path(tmp_dir)
        cluster = Cluster(spec, tmp, flow=target.startswith("gateway-flow"),
                          slots=target in ("gateway-flow", "gateway-flow-preempt"),
                          preempts=target == "gateway-flow-preempt")
        try:
            router: Router = start_router("gateway" if target.startswith("gateway") else target, cluster, tmp)  # type: ignore[arg-type]
            try:
                rng = random.Random(spec.seed + repetition)
                alone = asyncio.run(run_phase(router.url, spec, spec.alone_s, False, rng))
                flood = asyncio.run(run_phase(router.url, spec, spec.flood_s, True, rng))
            finally:
                router.stop()
        finally:
            cluster.close()
    return {"target": target, "repetition": repetition, "alone": figures(alone, spec, spec.alone_s),
            "flood": figures(flood, spec, spec.flood_s)}


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    by: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by.setdefault(row["target"], []).append(row)

    def med(target: str, *path: str) -> float | None:
        values: list[float | None] = []
        for row in by.get(target, []):
            node: Any = row
            for key in path:
                node = node.get(key) if isinstance(node, dict) else None
            values.append(node)
        return _median(values)

    result: dict[str, Any] = {"targets": {t: {
        "interactive_ttft_p99_alone_s": med(t, "alone", "interactive", "ttft_p99_s"),
        "interactive_ttft_p99_flood_s": med(t, "flood", "interactive", "ttft_p99_s"),
        "interactive_goodput_alone_rps": med(t, "alone", "interactive", "goodput_rps"),
        "interactive_goodput_flood_rps": med(t, "flood", "interactive", "goodput_rps"),
        "interactive_good_share_alone": med(t, "alone", "interactive", "good_share"),
        "interactive_good_share_flood": med(t, "flood", "interactive", "good_share"),
        "agent_ttft_p99_flood_s": med(t, "flood", "agent", "ttft_p99_s"),
        "batch_ttft_p50_flood_s": med(t, "flood", "batch", "ttft_p50_s"),
        "cluster_goodput_flood_rps": med(t, "flood", "goodput_rps"),
        "hit_rate_flood": med(t, "flood", "hit_rate"),
        "shed_rate_flood": {tenant: med(t, "flood", tenant, "shed_rate") for tenant in KEYS},
        "lost": med(t, "flood", "lost"),
    } for t in by}}
    peers = [result["targets"][p]["cluster_goodput_flood_rps"] for p in PEERS if p in result["targets"]]
    best_peer = max((p for p in peers if p is not None), default=None)
    result["flow_targets"] = {t: {  # the headline ratios of every flow-control variant run
        "interactive_ttft_p99_flood_vs_alone": _ratio(f["interactive_ttft_p99_flood_s"],
                                                      f["interactive_ttft_p99_alone_s"]),
        # per offered request (goodput / arrival rate): the two phases draw different arrivals
        "interactive_goodput_flood_vs_alone": _ratio(f["interactive_good_share_flood"],
                                                     f["interactive_good_share_alone"]),
        "goodput_vs_best_peer": _ratio(f["cluster_goodput_flood_rps"], best_peer),
        "shed_non_flex": _median([sum(r["flood"].get(n, {}).get("shed", 0) for n in ("interactive", "agent"))
                                  for r in by[t]]),
        "lost": _median([r["flood"]["lost"] + r["alone"]["lost"] for r in by[t]]),
    } for t, f in result["targets"].items() if t.startswith("gateway-flow")}
    flow = result["targets"].get("gateway-flow")
    if flow is not None:
        no_flow = result["targets"].get("gateway", {})
        no_slots = result["targets"].get("gateway-flow-noslots", {})
        result.update(
            **result["flow_targets"]["gateway-flow"],
            # the flex slot share's own effect: the same flow control without it
            interactive_ttft_p99_flood_vs_noslots=_ratio(flow["interactive_ttft_p99_flood_s"],
                                                         no_slots.get("interactive_ttft_p99_flood_s")),
            goodput_vs_noslots=_ratio(flow["cluster_goodput_flood_rps"], no_slots.get("cluster_goodput_flood_rps")),
            goodput_vs_no_flow_control=_ratio(flow["cluster_goodput_flood_rps"],
                                              no_flow.get("cluster_goodput_flood_rps")),
            hit_rate_vs_no_flow_control=_ratio(flow["hit_rate_flood"], no_flow.get("hit_rate_flood")),
        )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--targets", default="gateway-flow,gateway,sglang-router,vllm-router")
    parser.add_argument("--no-peers", action="store_true", help="skip sglang-router and vllm-router")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--decode-tps", type=float, default=30.0, help="tokens/s per sequence")
    parser.add_argument("--max-num-seqs", type=int, default=4)
    parser.add_argument("--output-tokens", type=int, default=30)
    parser.add_argument("--alone-s", type=float, default=30.0)
    parser.add_argument("--flood-s", type=float, default=60.0)
    parser.add_argument("--flood-x", type=float, default=2.5, help="batch arrivals, x capacity")
    parser.add_argument("--interactive-x", type=float, default=0.25, help="interactive arrivals, x capacity")
    parser.add_argument("--agent-sessions", type=int, default=2)
    parser.add_argument("--interactive-ttft-s", type=float, default=2.0)
    parser.add_argument("--agent-ttft-s", type=float, default=4.0)
    parser.add_argument("--flex-ttft-s", type=float, default=60.0)
    parser.add_argument("--flex-share", type=float, default=1.0, help="gateway-flow's flex_max_share")
    parser.add_argument("--flex-yield-ms", type=float, default=10_000.0, help="gateway-flow's flex_yield_window_ms")
    parser.add_argument("--batch-output-tokens", type=int, default=0,
                        help="the batch tenant's answer length (default --output-tokens): batch jobs' answers are "
                             "often longer than chat's, and hold decode slots that much longer")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    # A stopped run (timeout, Ctrl-C elsewhere) still stops its clusters and routers: they run in
    # sessions of their own and would outlive it.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    targets = [t for t in args.targets.split(",") if t and not (args.no_peers and t in PEERS)]
    spec = Spec(workers=args.workers, decode_tps=args.decode_tps, max_num_seqs=args.max_num_seqs,
                output_tokens=args.output_tokens, alone_s=args.alone_s, flood_s=args.flood_s, flood_x=args.flood_x,
                interactive_x=args.interactive_x, agent_sessions=args.agent_sessions,
                targets_s={"interactive": args.interactive_ttft_s, "agent": args.agent_ttft_s,
                           "batch": args.flex_ttft_s}, seed=args.seed, flex_share=args.flex_share,
                flex_yield_ms=args.flex_yield_ms, batch_output_tokens=args.batch_output_tokens)
    print(f"capacity ~{spec.capacity_rps:.1f} req/s; interactive {spec.interactive_x * spec.capacity_rps:.1f}/s, "
          f"batch flood {spec.flood_x * spec.capacity_rps:.1f}/s, {spec.agent_sessions} agent sessions", flush=True)
    rows = []
    for repetition in range(args.repeats):
        order = targets if repetition % 2 == 0 else list(reversed(targets))
        for target in order:
            row = run_target(target, spec, repetition)
            rows.append(row)
            alone, flood = row["alone"], row["flood"]
            print(f"{target:14s} rep {repetition}: interactive p99 alone {alone['interactive']['ttft_p99_s']} "
                  f"flood {flood['interactive']['ttft_p99_s']}; goodput flood {flood['goodput_rps']}/s; "
                  f"shed {json.dumps({t: v.get('shed') for t, v in flood.items() if isinstance(v, dict)})}; "
                  f"lost {alone['lost'] + flood['lost']}", flush=True)
    print(json.dumps({"rows": rows, **summary(rows)}))


if __name__ == "__main__":
    main()
