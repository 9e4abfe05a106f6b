"""Chaos run of the shipped compose topology on one machine: faults in turn under a bounded
open-loop load, and what each one cost.

    sudo python bench/chaos.py [--short] [--time-scale 1.0] [--log-dir DIR]

Hosts (bench/_netns.py: a network namespace each, veth to a private bridge, no route beyond
it): `redis`, `dns`, `gw1`, `gw2`, sim workers `w1`..`w4`, a spare `w5`, and `client`, where this
script's driver runs (load, faults, checks). What runs on them and how it is configured
from the shipped files: bench/_chaos_cluster.py. The load (multi-turn sessions, open loop,
the project's load generator, spread over both replicas as the shipped nginx does):
bench/_chaos_workload.py and bench/_chaos_load.py.

Faults, in turn, each at the start of a phase of at least its schedule's length (a phase
starts late when the one before took longer, e.g. a slow gateway start):
1. redis: SIGKILL, restarted 1 s later with the same command and data directory (a pod
   restarted on its volume; with --redis-volume-lost on an empty one). The API keys
   written before it (the load's, an admin key, and a probe key never used before) are
   tried on both replicas once their key cache (10 s) has expired. Keys found lost are
   added again, as an operator would, so that later phases measure their own fault.
2. worker: w4 SIGKILLed, w5 started at a new address, and the DNS name the gateways discover
   workers by (a real dnsmasq on the `dns` host) answers w5 instead of w4: time until both
   replicas route to w5, and until neither routes to w4 (draining or removed).
3. gateway: gw2 SIGKILLed, restarted 3 s later. Its fresh process must show the routing
   change made through the admin API before the Redis restart.
4. link: Redis's link down for 10 s (`ip link set down` on its bridge port): both gateways
   lose Redis, packets dropped, no reset.
Then, from the client host (any pod): each live worker's /v1/worker/* without the token and
with a wrong one, and Redis without its password.

Last line: one JSON object:
- `requests_total` (sent), `requests_answered`, `requests_failed`, `requests_lost`
  (bench/_chaos_figures.py defines them), `failed_by_kind`, `failed_by_phase` (by send time);
  `resent_to_other_replica`: refused connections re-sent to the other replica.
- `keys_valid_after_redis_restart`: every key answered 200 on both replicas after the Redis
  restart; `admin_changes_kept_after_redis_restart`: the restarted gw2's GET /admin/routing
  equals gw1's answer to the change (polled for 15 s after gw2 is ready), whether Redis kept
  the change or a surviving replica wrote it back (`admin_routing_in_redis_on_restart`: what
  Redis held the moment it answered again).
- `index_hit_recovery_s`: from the Redis kill to the start of the first 4 s window of send
  time from which every window of the phase has a follow-up hit rate within 10% of the
  one over the `before_s` before the kill. Only follow-ups whose previous turn was answered
  count (one whose previous turn failed has less to hit, whatever the index). Null when the
  last window of the phase had not recovered.
- `unauthenticated_worker_calls_refused`: every call without or with a wrong token got 401
  and no worker's prompt token counter moved; `unauthenticated_redis_refused`.
- the details each of those was decided on, the schedule and the event times.

Needs root (network namespaces) and iproute2. The script runs itself again on the client
host; the outer process builds the hosts and removes them whatever happens, after removing
what earlier runs killed outright left behind.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sibling bench modules

from _chaos_cluster import WORKER_PORT, Cluster, http, wait_tcp
from _chaos_figures import HitSample, between, hit_rate, outcome, recovery_s, tally
from _chaos_load import LoadRun, run_load
from _chaos_workload import SessionLoad, SessionTrace, session_trace
from _netns import Lab, netns_usable, run_name, sweep_stale

from deepinfer_gateway.core.protocol import GENERATE_PATH, KV_EVENTS_PATH, LOAD_PATH
from deepinfer_gateway.gateway.fleet.admin_store import ROUTING_KEY
from deepinfer_gateway.workload.synthesis import PromptSynthesizer

GATEWAYS = ("gw1", "gw2")
WORKERS = ("w1", "w2", "w3", "w4")
SPARE = "w5"
HOSTS = ("client", "redis", "dns", *GATEWAYS, *WORKERS, SPARE)
KEY_CACHE_S = 10.0  # gateway/serving/auth.py KeyStore's cache_ttl_s: a key is read from Redis again after it
ROUTING_CHANGE = {"policy": {"name": "estimated_ttft", "stick_ratio": 1.75}, "decode_policy": "power_of_two"}


@dataclass(frozen=True)
class Schedule:
    """Least lengths of the phases (s of load); each fault hits at the start of its phase."""

    warmup_s: float
    redis_s: float
    worker_s: float
    gateway_s: float
    link_s: float
    redis_down_s: float = 1.0
    gateway_down_s: float = 3.0
    link_cut_s: float = 10.0
    hit_window_s: float = 4.0
    before_s: float = 15.0  # the hit rate before the Redis kill: over this much send time

    @property
    def nominal_s(self) -> float:
        return self.warmup_s + self.redis_s + self.worker_s + self.gateway_s + self.link_s


FULL = Schedule(warmup_s=30, redis_s=45, worker_s=30, gateway_s=30, link_s=30)
SHORT = Schedule(warmup_s=16, redis_s=26, worker_s=14, gateway_s=16, link_s=18, before_s=10)
SLACK_S = 240.0  # the trace runs this much past the nominal end: room for phases that start late


class Timeline:
    """Seconds since the load started, and what happened when."""

    def __init__(self) -> None:
        self.t0: float | None = None
        self.ready = threading.Event()
        self.events: list[tuple[float, str]] = []

    def start(self, t0: float) -> None:
        self.t0 = t0
        self.ready.set()

    def now(self) -> float:
        assert self.t0 is not None
        return time.perf_counter() - self.t0

    def mark(self, what: str) -> float:
        t = round(self.now(), 3)
        self.events.append((t, what))
        print(f"[{t:7.2f}s] {what}", flush=True)
        return t

    def sleep_until(self, t: float) -> None:
        time.sleep(max(0.0, t - self.now()))


def add_key(cluster: Cluster, name: str, key: str | None = None) -> str:
    """A key in Redis as docs/deploy.md adds one (HSET dgw:apikey:<sha256>); admin when named so."""
    key = key or "sk-chaos-" + secrets.token_urlsafe(18)
    digest = hashlib.sha256(key.encode()).hexdigest()
    with cluster.redis_client() as client:
        client.hset(f"dgw:apikey:{digest}", mapping={"name": f"chaos-{name}", "admin": str(name == "admin").lower()})
    return key


class ChaosRun:
    def __init__(self, cluster: Cluster, schedule: Schedule, st: SessionTrace, synthesizer: PromptSynthesizer):
        self.cluster = cluster
        self.schedule = schedule
        self.st = st
        self.synthesizer = synthesizer
        self.timeline = Timeline()
        self.keys: dict[str, str] = {}
        self.changed_routing: Any = None
        self.out: dict[str, Any] = {}
        self.redis_volume_lost = False

    def admin(self, method: str, gateway: str, path: str, body: Any = None) -> tuple[int, Any]:
        return http(method, self.cluster.url(gateway) + path, self.keys["admin"], body)

    def start(self) -> None:
        c = self.cluster
        c.start_redis()
        for w in WORKERS:
            c.start_worker(w)
        for w in WORKERS:
            wait_tcp(c.ip(w), WORKER_PORT, 60, c.procs[w])
        c.start_dns(list(WORKERS))
        for g in GATEWAYS:
            c.start_gateway(g)
        for g in GATEWAYS:
            c.wait_ready(g, len(WORKERS), timeout=120)
        self.keys = {name: add_key(c, name) for name in ("load", "admin")}
        _, before = self.admin("GET", "gw1", "/admin/routing")
        status, self.changed_routing = self.admin("PUT", "gw1", "/admin/routing", ROUTING_CHANGE)
        if status != 200 or self.changed_routing == before:
            raise RuntimeError(f"the routing change was refused: {status} {self.changed_routing}")
        self.out["admin_change"] = ROUTING_CHANGE

    def run(self) -> dict[str, Any]:
        s, tl = self.schedule, self.timeline
        stop = threading.Event()
        load: dict[str, LoadRun] = {}
        failure: list[BaseException] = []

        def load_thread() -> None:
            try:
                load["run"] = run_load([self.cluster.url(g) for g in GATEWAYS], self.keys["load"], self.st,
                                       self.synthesizer, stop, tl.start)
            except BaseException as exc:  # raised again by the main thread
                failure.append(exc)
                tl.ready.set()

        thread = threading.Thread(target=load_thread, name="load", daemon=True)
        thread.start()
        tl.ready.wait()
        if failure:
            raise failure[0]
        tl.mark("load started")
        try:
            t_redis = self.redis_phase(s.warmup_s)
            t_worker = self.worker_phase(t_redis + s.redis_s)
            t_gateway = self.gateway_phase(t_worker + s.worker_s)
            t_link = self.link_phase(t_gateway + s.gateway_s)
            tl.sleep_until(t_link + s.link_s)
        finally:
            stop.set()
        t_end = tl.mark("load: no more requests sent")
        thread.join(timeout=300)
        if failure:
            raise failure[0]
        if "run" not in load:
            raise RuntimeError("the load did not drain in 300 s")
        tl.mark("load drained")
        self.rogue_checks()
        faults = {"redis": t_redis, "worker": t_worker, "gateway": t_gateway, "link": t_link, "end": t_end}
        self.out.update(figures(load["run"], self.st, s, faults))
        self.out["events"] = tl.events
        return self.out

    def redis_phase(self, at: float) -> float:
        c, tl, s = self.cluster, self.timeline, self.schedule
        tl.sleep_until(at - 3)
        self.keys["probe"] = add_key(c, "probe")  # never used before the restart: in no cache
        tl.sleep_until(at)
        t = tl.mark("redis: SIGKILL")
        c.kill("redis")
        if self.redis_volume_lost:  # a node lost with its disk: only the rebuildable state may come back
            shutil.rmtree(c.redis_dir)
            c.redis_dir.mkdir()
        time.sleep(s.redis_down_s)
        c.start_redis()
        t_back = tl.mark(f"redis: restarted{' on an empty volume' if self.redis_volume_lost else ''}, answering")
        with c.redis_client() as client:  # before a surviving replica may write its admin state back
            self.out["admin_routing_in_redis_on_restart"] = bool(client.hgetall(ROUTING_KEY))
        time.sleep(2.0)
        self.out["index_after_redis_restart"] = self.admin("GET", "gw1", "/admin/index")[1]
        tl.sleep_until(t_back + KEY_CACHE_S + 1.0)
        statuses = {g: {name: http("GET", c.url(g) + "/v1/models", key)[0] for name, key in self.keys.items()}
                    for g in GATEWAYS}
        valid = all(code == 200 for by_key in statuses.values() for code in by_key.values())
        tl.mark(f"redis: keys after the restart {statuses}")
        self.out |= {"keys_valid_after_redis_restart": valid, "key_statuses_after_redis_restart": statuses,
                     "keys_added_again_after_redis_restart": not valid}
        if not valid:
            for name, key in self.keys.items():
                add_key(c, name, key)
            tl.mark("redis: keys lost, added again")
        return t

    def worker_views(self) -> list[dict[str, str]]:
        """Per replica: worker URL -> healthy, draining or unhealthy."""
        views = []
        for g in GATEWAYS:
            status, body = self.admin("GET", g, "/admin/workers")
            workers = body["workers"] if status == 200 and isinstance(body, dict) else []
            views.append({w["url"]: "draining" if w.get("draining") else "healthy" if w["healthy"] else "unhealthy"
                          for w in workers})
        return views

    def worker_phase(self, at: float) -> float:
        c, tl = self.cluster, self.timeline
        tl.sleep_until(at)
        t = tl.mark(f"worker: SIGKILL w4; {SPARE} starts at {c.ip(SPARE)}, DNS answers it instead of w4")
        c.kill("w4")
        c.start_worker(SPARE)
        wait_tcp(c.ip(SPARE), WORKER_PORT, 60, c.procs[SPARE])
        c.set_dns(["w1", "w2", "w3", SPARE])
        new, old = c.url(SPARE), c.url("w4")
        found = gone = None
        views = self.worker_views()
        deadline = tl.now() + 60
        while tl.now() < deadline and (found is None or gone is None):
            views = self.worker_views()
            if found is None and all(v.get(new) == "healthy" for v in views):
                found = round(tl.now() - t, 2)
            if gone is None and all(v.get(old, "gone") in ("gone", "draining") for v in views):
                gone = round(tl.now() - t, 2)
            time.sleep(0.25)
        tl.mark(f"worker: both replicas route to {SPARE} after {found} s, stopped routing to w4 after {gone} s")
        self.out["worker_replacement"] = {
            "via": "DNS discovery", "new_worker_healthy_on_both_s": found, "old_worker_out_of_routing_s": gone,
            "views": dict(zip(GATEWAYS, views, strict=True))}
        return t

    def gateway_phase(self, at: float) -> float:
        c, tl, s = self.cluster, self.timeline, self.schedule
        tl.sleep_until(at)
        t = tl.mark("gateway: SIGKILL gw2")
        c.kill("gw2")
        time.sleep(s.gateway_down_s)
        c.start_gateway("gw2")
        c.wait_ready("gw2", 1, timeout=120)
        t_ready = tl.mark("gateway: gw2 ready again")
        routing: Any = None
        deadline = tl.now() + 15
        while tl.now() < deadline:
            routing = self.admin("GET", "gw2", "/admin/routing")[1]
            if routing == self.changed_routing:
                break
            time.sleep(0.5)
        kept = routing == self.changed_routing
        tl.mark(f"gateway: the routing change {'is' if kept else 'is NOT'} on the restarted gw2")
        self.out |= {"admin_changes_kept_after_redis_restart": kept, "routing_on_restarted_gw2": routing,
                     "routing_after_change": self.changed_routing, "gateway_restart_to_ready_s": round(t_ready - t, 2)}
        return t

    def link_phase(self, at: float) -> float:
        tl = self.timeline
        tl.sleep_until(at)
        t = tl.mark("link: Redis's link down")
        self.cluster.lab.set_link("redis", up=False)
        try:
            time.sleep(self.schedule.link_cut_s)
        finally:
            self.cluster.lab.set_link("redis", up=True)
        tl.mark("link: Redis's link up")
        return t

    def rogue_checks(self) -> None:
        """From the client host, as any pod: each live worker without the token and with a
        wrong one (nothing may start: its prompt token counter must not move), Redis without
        the password."""
        c = self.cluster
        body = {"request_id": "rogue-" + secrets.token_hex(4), "token_ids": [1, 2, 3, 4],
                "sampling": {"max_tokens": 4}}

        def prompt_total(w: str) -> int | None:
            status, load = http("GET", c.url(w) + LOAD_PATH, c.worker_token)
            return int(load["prompt_tokens_total"]) if status == 200 and isinstance(load, dict) else None

        calls: dict[str, Any] = {}
        for w in ("w1", "w2", "w3", SPARE):
            before = prompt_total(w)
            statuses = {}
            for label, token in (("no_token", None), ("wrong_token", "wrong-" + secrets.token_hex(8))):
                statuses[f"generate_{label}"] = http("POST", c.url(w) + GENERATE_PATH, token, body)[0]
                statuses[f"kv_events_{label}"] = http("GET", c.url(w) + KV_EVENTS_PATH + "?after=0&limit=1",
                                                      token)[0]
                statuses[f"load_{label}"] = http("GET", c.url(w) + LOAD_PATH, token)[0]
            time.sleep(0.5)  # a generate that did start has computed its prompt by now
            calls[w] = {"statuses": statuses, "prompt_tokens_before": before, "prompt_tokens_after": prompt_total(w),
                        "health_without_token": http("GET", c.url(w) + "/health")[0]}
        refused = all(code == 401 for w in calls.values() for code in w["statuses"].values()) and all(
            w["prompt_tokens_before"] is not None and w["prompt_tokens_before"] == w["prompt_tokens_after"]
            for w in calls.values())
        self.out |= {"unauthenticated_worker_calls_refused": refused, "unauthenticated_worker_calls": calls}
        try:
            with c.redis_client(password=None) as client:
                client.ping()
                client.hset("dgw:apikey:" + "0" * 64, "admin", "true")
            redis_refused, answer = False, "PING and HSET dgw:apikey:... answered without a password"
        except redis.AuthenticationError as exc:
            redis_refused, answer = True, f"{type(exc).__name__}: {exc}"
        except redis.ResponseError as exc:
            redis_refused, answer = "NOAUTH" in str(exc), f"{type(exc).__name__}: {exc}"
        self.out |= {"unauthenticated_redis_refused": redis_refused, "redis_without_password": answer}


def figures(run: LoadRun, st: SessionTrace, schedule: Schedule, faults: dict[str, float]) -> dict[str, Any]:
    counts = tally(run.records)
    outcomes = {r.index: outcome(r) for r in run.records}

    def counted(index: int) -> bool:  # an answered follow-up whose previous turn was answered
        previous = st.previous[index]
        return outcomes[index] == "answered" and previous is not None and outcomes.get(previous) == "answered"

    samples = [HitSample(r.arrival_s, r.cached_tokens or 0, r.prompt_tokens or 0) for r in run.records
               if counted(r.index)]
    names = ["warmup", "redis", "worker", "gateway", "link"]
    edges = [0.0] + [faults[n] for n in names[1:]] + [faults["end"]]
    bounds = {n: (edges[i], edges[i + 1]) for i, n in enumerate(names)}
    failed_by_phase = {n: sum(1 for r in run.records if lo <= r.arrival_s < hi and outcomes[r.index] == "failed")
                       for n, (lo, hi) in bounds.items()}
    before = hit_rate(between(samples, faults["redis"] - schedule.before_s, faults["redis"]))
    recovery = recovery_s(samples, faults["redis"], faults["worker"], before, schedule.hit_window_s) if before else None
    return {
        "requests_total": counts.total, "requests_answered": counts.answered, "requests_failed": counts.failed,
        "requests_lost": counts.lost, "failed_by_kind": counts.failed_by_kind, "failed_by_phase": failed_by_phase,
        "failure_examples": counts.examples,
        "failed_sent_at_s": [round(r.arrival_s, 2) for r in run.records if outcomes[r.index] == "failed"][:20],
        "resent_to_other_replica": run.resent, "attempts_per_replica": dict(zip(GATEWAYS, run.attempts, strict=True)),
        "follow_up_hit_before_redis_kill": _round(before),
        "follow_up_hit_by_phase": {n: _round(hit_rate(between(samples, lo, hi))) for n, (lo, hi) in bounds.items()},
        "index_hit_recovery_s": recovery,
        "index_hit_recovery_observed_for_s": round(faults["worker"] - faults["redis"], 2),
        "fault_times_s": faults,
    }


def _round(x: float | None) -> float | None:
    return round(x, 4) if x is not None else None


def drive(args: argparse.Namespace) -> dict[str, Any]:
    """On the client host: start the cluster, run the schedule, return the figures."""
    schedule = SHORT if args.short else FULL
    workdir = Path(args.log_dir or tempfile.mkdtemp(prefix="dgw-chaos-"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"logs: {workdir}", flush=True)
    cluster = Cluster(Lab(args.run, HOSTS), workdir, GATEWAYS, WORKERS, args.time_scale)
    st = session_trace(SessionLoad(duration_s=schedule.nominal_s + SLACK_S))
    chaos = ChaosRun(cluster, schedule, st, PromptSynthesizer.for_default_tokenizer(st.trace.block_size))
    chaos.redis_volume_lost = args.redis_volume_lost
    chaos.out |= {"schedule": asdict(schedule), "time_scale": args.time_scale,
                  "redis_volume_lost": args.redis_volume_lost, "redis_command": cluster.redis_cmd()[-1]}
    try:
        chaos.start()
        return chaos.run()
    finally:
        cluster.stop_all()


def outer(argv: list[str]) -> int:
    """Build the hosts, run the driver on the client host, remove the hosts whatever happens."""
    if (why := netns_usable()) is not None:
        print(f"chaos: network namespaces unavailable: {why}", file=sys.stderr)
        return 2
    if swept := sweep_stale():
        print(f"removed namespaces left by earlier runs: {' '.join(swept)}", file=sys.stderr)
    lab = Lab(run_name(os.getpid()), HOSTS)

    def stop(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    try:
        lab.create()
        cmd = lab.exec_prefix("client") + [sys.executable, str(Path(__file__).resolve()), "--inner", lab.run, *argv]
        return subprocess.run(cmd).returncode
    finally:
        with contextlib.suppress(KeyboardInterrupt):
            lab.destroy()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--short", action="store_true", help="the suite's short schedule (about 90 s of load)")
    parser.add_argument("--time-scale", type=float, default=1.0, help="sim workers: divide simulated durations by this")
    parser.add_argument("--log-dir", help="the processes' logs (default: a new temporary directory)")
    parser.add_argument("--redis-volume-lost", action="store_true",
                        help="Redis restarts on an empty data volume: the prefix index must be refilled from the "
                             "workers; keys found lost are added again")
    parser.add_argument("--inner", metavar="RUN", help=argparse.SUPPRESS)  # the driver, on the client host
    args = parser.parse_args()
    if args.inner is None:
        sys.exit(outer(sys.argv[1:]))
    args.run = args.inner
    print(json.dumps(drive(args)))


if __name__ == "__main__":
    main()
