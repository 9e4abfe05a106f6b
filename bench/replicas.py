"""N gateway replicas in front of one cold sim cluster: do follow-up turns still hit the cache
when a load balancer sends each turn to a random replica?

    python bench/replicas.py [--replicas 1,2,4,8] [--sessions 24] [--turns 4]
                             [--session-interval-s 0.6] [--think-s 1.0]

For each N, and per mode, a COLD cluster (a fresh `sim-cluster`, `--workers`, memory tier
only: `--no-store`, so a hit needs the prompt on the worker the request went to) and N
fresh `serve` processes on their own ports:
- `shared`: every replica on one Redis (started here, redis_process.py; emptied per run):
  one prefix index, shared in-flight reservations;
- `per_replica` (the baseline): no Redis, each replica its own in-memory index (fed by its
  own polls of every worker's KV events) and its own reservations;
- `shared_local_sessions` (only with `--modes`): as `shared`, but each replica counts only its
  own live sessions against the workers' caches (`session_capacity.shared = false`): what
  sharing the sessions adds, with `--session-ids`, `--memory-blocks` and session capacity on
  in `--gateway-toml`.
Modes alternate per N (in `--modes` order, default shared then per_replica) so all see the
same machine. `--session-ids` sends each session's id (`x-session-id`), `--memory-blocks N`
sizes each worker's prefix cache (sim-cluster's), `--gateway-toml` adds settings to every
replica (e.g. `'[session_capacity]\nenabled = true'`).

Workload: multi-turn chat sessions (`--sessions` x `--turns`), one started every
`--session-interval-s`; each turn sends the whole conversation so far (one of 4 shared
system prompts of ~1,500 words, then per turn a ~150-word user message and, in the
history, a ~60-word assistant answer written here, so turn k's prompt extends turn k-1's)
and the next turn follows `--think-s` after the answer. Every request goes to a replica
drawn at random (seeded; the same draws for both modes), streaming, `max_tokens` 8,
thinking off, through the openai SDK with no client retries. Sessions are synthesized
rather than read from the Mooncake conversation trace: its rows carry no session id, so a
follow-up turn (and the replica its session used before) cannot be told apart there.

Figures per N and mode
- `follow_up_hit`: sum of cached / sum of prompt tokens over follow-up turns (turn >= 2),
  from each response's usage; `first_turn_hit` the same for first turns.
- `ttft_p50_s`, `ttft_p99_s`: client-side time to the first content chunk, ok requests
  (wall seconds at the sim's `--time-scale`).
- `errors` (non-200 or a failed stream), `lost` (sent requests with neither an answer nor an
  error, plus requests no gateway counted in `dgw_requests_total`), `duplicated` (gateway
  counts above the requests sent); `worker_prompt_tokens_minus_client`: the workers'
  `prompt_tokens_total` (load reports) less the prompt tokens of the ok answers: 0 when every
  answered request ran on a worker exactly once.
- `session_waits`, `session_proceeded`: session capacity's rounds that waited for room, and
  those that went at the wait's bound (`max_wait_ms`), over every replica.
Last line: one JSON object with `rows` (shared), `per_replica_rows`, `follow_up_hit_ratio_min`
(min over N of follow-up hit at N / at the smallest N), `ttft_p99_ratio_8_to_1` (largest N to
smallest), the same two for each other mode prefixed with its name (`per_replica_...`), and
`nothing_lost_or_duplicated`.

Sized for 2 shared cores: 8 gateway processes each poll every worker's KV events, so the
replicas poll every 0.2 s (`router.kv_events_interval_s`, default 0.05 s) in both modes, and
the request rate stays near 5 requests/s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import redis
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # harness/, at the repository root
from deepinfer_gateway.core.protocol import DEFAULT_MODEL, LOAD_PATH
from deepinfer_gateway.infra.redis_process import RedisProcess
from harness.launch import Gateway, SimCluster

DEFAULT_WORKERS = "unified:sm100,unified:sm100,unified:sm100,unified:sm100"
MODES = ("shared", "per_replica", "shared_local_sessions")
SYSTEM_PROMPTS = 4
WORDS = ("time year people way day man thing woman life child world school state family student group country "
         "problem hand part place case week company system program question work government number night point "
         "home water room mother area money story fact month lot right study book eye job word business issue "
         "side kind head house service friend father power hour game line end member law car city community name "
         "president team minute idea kid body information back parent face others level office door health person "
         "art war history party result change morning reason research girl guy moment air teacher force "
         "education").split()


@dataclass
class Outcome:
    session: int
    turn: int
    replica: int
    ok: bool = False
    error: str = ""
    ttft_s: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0


@dataclass
class Workload:
    systems: list[str]
    users: list[list[str]]  # [session][turn]
    answers: list[list[str]]
    system_of: list[int]
    replica_of: dict[int, list[list[int]]] = field(default_factory=dict)  # N -> [session][turn]


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def make_workload(sessions: int, turns: int, replicas: list[int], seed: int) -> Workload:
    rng = random.Random(seed)
    systems = [f"System prompt {k}. " + _text(rng, 1500) for k in range(SYSTEM_PROMPTS)]
    users = [[f"Session {s} turn {t}: " + _text(rng, 150) for t in range(turns)] for s in range(sessions)]
    answers = [[_text(rng, 60) for _ in range(turns)] for _ in range(sessions)]
    work = Workload(systems, users, answers, [rng.randrange(SYSTEM_PROMPTS) for _ in range(sessions)])
    for n in replicas:
        draw = random.Random(seed * 1000 + n)
        work.replica_of[n] = [[draw.randrange(n) for _ in range(turns)] for _ in range(sessions)]
    return work


def messages(work: Workload, session: int, turn: int) -> list[Any]:  # the SDK's message params
    out: list[Any] = [{"role": "system", "content": work.systems[work.system_of[session]]}]
    for t in range(turn):
        out += [{"role": "user", "content": work.users[session][t]},
                {"role": "assistant", "content": work.answers[session][t]}]
    return out + [{"role": "user", "content": work.users[session][turn]}]


async def one_turn(client: openai.AsyncOpenAI, work: Workload, out: Outcome, session_ids: bool) -> None:
    started = time.perf_counter()
    headers = {"x-session-id": f"bench-session-{out.session}"} if session_ids else {}
    try:
        stream = await client.chat.completions.create(
            model=DEFAULT_MODEL, messages=messages(work, out.session, out.turn), max_tokens=8, stream=True,
            stream_options={"include_usage": True}, extra_body={"thinking": {"type": "disabled"}},
            extra_headers=headers)
        async for chunk in stream:
            if out.ttft_s is None and chunk.choices and chunk.choices[0].delta.content:
                out.ttft_s = time.perf_counter() - started
            if chunk.usage is not None:
                out.prompt_tokens = chunk.usage.prompt_tokens
                details = chunk.usage.prompt_tokens_details
                out.cached_tokens = (details.cached_tokens or 0) if details else 0
        out.ok = chunk.usage is not None
        out.error = "" if out.ok else "no usage"
    except (openai.APIError, ValueError) as exc:
        out.error = type(exc).__name__


async def replay(urls: list[str], work: Workload, sessions: int, turns: int, interval_s: float,
                 think_s: float, session_ids: bool = False) -> list[Outcome]:
    n = len(urls)
    clients = [openai.AsyncOpenAI(base_url=u + "/v1", api_key="bench", max_retries=0, timeout=120) for u in urls]
    outcomes: list[Outcome] = []

    async def session(s: int) -> None:
        await asyncio.sleep(s * interval_s)
        for t in range(turns):
            out = Outcome(s, t, work.replica_of[n][s][t])
            outcomes.append(out)
            await one_turn(clients[out.replica], work, out, session_ids)
            await asyncio.sleep(think_s)

    await asyncio.gather(*(session(s) for s in range(sessions)))
    for c in clients:
        await c.close()
    return outcomes


def _get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.load(r)


def counted(gateway_url: str, name: str = "dgw_requests_total") -> float:
    with urllib.request.urlopen(gateway_url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == name)


def pct(values: list[float], q: float) -> float | None:
    s = sorted(values)
    return round(s[min(len(s) - 1, int(q * len(s)))], 4) if s else None


def _hit(outs: list[Outcome]) -> float | None:
    prompt = sum(o.prompt_tokens for o in outs)
    return round(sum(o.cached_tokens for o in outs) / prompt, 4) if prompt else None


def start_gateways(tmp: Path, cluster: SimCluster, n: int, redis_url: str | None, extra_toml: str = "",
                   env: dict[str, str] | None = None) -> list[Gateway]:
    workers = [(url, *spec.split(":")) for url, spec in zip(cluster.urls, cluster.specs, strict=True)]
    toml = ((f'redis.url = "{redis_url}"\n' if redis_url else "") + extra_toml
            + "\n[router]\nkv_events_interval_s = 0.2\n")

    def start() -> Gateway:
        return Gateway(tmp, workers, extra_toml=toml, health_interval_s=1.0, env=env)  # type: ignore[arg-type]

    with ThreadPoolExecutor(n) as pool:  # each start waits for its port: start them side by side
        futures = [pool.submit(start) for _ in range(n)]
    gateways = [f.result() for f in futures if f.exception() is None]
    try:
        if len(gateways) < n:
            raise next(f.exception() for f in futures if f.exception() is not None)  # type: ignore[misc]
        for gw in gateways:
            gw.wait_ready(len(workers), timeout=60)
    except BaseException:
        for gw in gateways:
            gw.stop()
        raise
    return gateways


def run_one(args: argparse.Namespace, work: Workload, n: int, mode: str, redis_url: str) -> dict[str, Any]:
    uses_redis = mode != "per_replica"
    if uses_redis:
        redis.Redis.from_url(redis_url).flushall()
    memory = ["--memory-blocks", str(args.memory_blocks)] if args.memory_blocks else []
    cluster = SimCluster(args.workers, time_scale=args.time_scale, extra=["--no-store", *memory])
    env = {"DGW_SESSION_CAPACITY__SHARED": "false"} if mode == "shared_local_sessions" else None
    gateways: list[Gateway] = []
    try:
        with tempfile.TemporaryDirectory(prefix="dgw-bench-replicas-") as tmp:
            gateways = start_gateways(Path(tmp), cluster, n, redis_url if uses_redis else None, args.gateway_toml,
                                      env)
            t0 = time.perf_counter()
            outs = asyncio.run(replay([g.url for g in gateways], work, args.sessions, args.turns,
                                      args.session_interval_s, args.think_s, args.session_ids))
            wall = time.perf_counter() - t0
            requests = sum(counted(g.url) for g in gateways)
            waits = sum(counted(g.url, "dgw_session_waits_total") for g in gateways)
            proceeded = sum(counted(g.url, "dgw_session_proceeded_total") for g in gateways)
            loads = [_get_json(u + LOAD_PATH) for u in cluster.urls]
    finally:
        for gw in gateways:
            gw.stop()
        cluster.stop()
    ok = [o for o in outs if o.ok]
    sent = args.sessions * args.turns
    errors = sum(1 for o in outs if not o.ok and o.error)
    unanswered = sent - len(ok) - errors
    row = {
        "replicas": n, "mode": mode, "sent": sent, "ok": len(ok), "errors": errors,
        "lost": unanswered + max(0, sent - int(requests)), "duplicated": max(0, int(requests) - sent),
        "follow_up_hit": _hit([o for o in ok if o.turn > 0]), "first_turn_hit": _hit([o for o in ok if o.turn == 0]),
        "ttft_p50_s": pct([o.ttft_s for o in ok if o.ttft_s is not None], 0.5),
        "ttft_p99_s": pct([o.ttft_s for o in ok if o.ttft_s is not None], 0.99),
        "worker_prompt_tokens_minus_client": sum(int(x["prompt_tokens_total"]) for x in loads)
        - sum(o.prompt_tokens for o in ok),
        "req_per_s": round(sent / wall, 2),
        "session_waits": int(waits), "session_proceeded": int(proceeded),  # session_capacity's, every replica's
    }
    print(json.dumps(row), flush=True)
    return row


def ratios(rows: list[dict[str, Any]]) -> tuple[float | None, float | None]:
    base = rows[0]
    hits = [r["follow_up_hit"] / base["follow_up_hit"] for r in rows if r["follow_up_hit"] and base["follow_up_hit"]]
    ttft = (rows[-1]["ttft_p99_s"] / base["ttft_p99_s"]) if rows[-1]["ttft_p99_s"] and base["ttft_p99_s"] else None
    return (round(min(hits), 4) if hits else None), (round(ttft, 3) if ttft else None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", default="1,2,4,8", help="gateway process counts, ascending")
    parser.add_argument("--sessions", type=int, default=24)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--session-interval-s", type=float, default=0.6)
    parser.add_argument("--think-s", type=float, default=1.0)
    parser.add_argument("--workers", default=DEFAULT_WORKERS)
    parser.add_argument("--time-scale", type=float, default=1.0, help="sim-cluster: divide simulated durations by this")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--modes", default="shared,per_replica", help=f"comma-separated, of {list(MODES)}")
    parser.add_argument("--session-ids", action="store_true", help="send each session's id (x-session-id)")
    parser.add_argument("--memory-blocks", type=int, default=0, help="each worker's prefix cache in KV blocks "
                                                                     "(0: the profile's)")
    parser.add_argument("--gateway-toml", default="", help="settings added to every replica's (TOML)")
    args = parser.parse_args()
    modes = args.modes.split(",")
    if unknown := set(modes) - set(MODES):
        parser.error(f"unknown modes {sorted(unknown)}; choose from {list(MODES)}")
    counts = [int(x) for x in args.replicas.split(",")]
    work = make_workload(args.sessions, args.turns, counts, args.seed)
    rows: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    with RedisProcess() as server:
        for n in counts:
            for mode in modes:
                rows[mode].append(run_one(args, work, n, mode, server.url))
    summary: dict[str, Any] = {}
    for mode in modes:
        prefix = "" if mode == "shared" else mode + "_"
        hit_min, ttft_ratio = ratios(rows[mode])
        summary |= {f"{prefix}follow_up_hit_ratio_min": hit_min, f"{prefix}ttft_p99_ratio_8_to_1": ttft_ratio}
    every = [r for mode in modes for r in rows[mode]]
    print(json.dumps(summary | {
        "nothing_lost_or_duplicated": all(r["lost"] == 0 and r["duplicated"] == 0 and r["errors"] == 0
                                          and r["worker_prompt_tokens_minus_client"] == 0 for r in every),
        "replica_counts": counts, "sessions": args.sessions, "turns": args.turns,
    } | {("rows" if mode == "shared" else f"{mode}_rows"): rows[mode] for mode in modes}))


if __name__ == "__main__":
    main()
