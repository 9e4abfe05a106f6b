"""A fresh gateway's first request: what a new process (a restart, a scale-up, another
`serve --processes` worker) makes its first clients wait for, against its next requests.

    python bench/first_request.py [--baseline DIR] [--rounds 7] [--system-words 1500]

Each round starts a gateway in front of one sim worker that answers at once (time scale
1000), waits for `/ready` to report the worker, then sends three agent-like first requests
one after another (a system prompt of `--system-words` words, a tool, a user turn; every
text new, so no cache helps; non-streaming, 4 output tokens) and stops it. `first_ms` is the
first request's latency, `next_ms` the median of the other two, `first_extra_ms` their
difference: the one-time cost the first client pays. `ready_s`: from the start of the
process until `/ready` reports the worker (where a warm-up at start shows). With `--baseline
DIR` a gateway from that source tree (`git archive <commit> | tar -x -C DIR`) starts in
every round too, the two alternating; its figures carry the prefix `baseline_`.

The last line is one JSON object: medians over rounds of the figures above, their per-round
values, and `first_extra_ratio` (this tree's over the baseline's) when there is one.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

from _harness import MODEL, start_worker

from harness.launch import Gateway

REQUESTS_PER_ROUND = 3


def agent_body(rng: random.Random, system_words: int) -> bytes:
    """An agent's first request, every word drawn anew: nothing in it is cached anywhere."""
    def words(n: int) -> str:
        return " ".join(f"w{rng.randrange(10**6)}" for _ in range(n))

    return json.dumps({
        "model": MODEL, "max_tokens": 4, "thinking": {"type": "disabled"},
        "tools": [{"type": "function", "function": {
            "name": "run_shell", "description": words(40),
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}}}],
        "messages": [{"role": "system", "content": words(system_words)},
                     {"role": "user", "content": words(60)}],
    }).encode()


def post_ms(url: str, body: bytes) -> float:
    started = time.perf_counter()
    request = urllib.request.Request(url, data=body, headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        response.read()
        if response.status != 200:
            raise SystemExit(f"request failed: {response.status}")
    return (time.perf_counter() - started) * 1000


def one_start(worker_url: str, tree: str | None, rng: random.Random, system_words: int) -> dict[str, float]:
    env = {"PYTHONSAFEPATH": "1", "PYTHONPATH": tree} if tree else None
    started = time.perf_counter()
    gateway = Gateway(Path(tempfile.mkdtemp()), [(worker_url, "unified", "sm100")], env=env)
    try:
        gateway.wait_ready(1, timeout=60)
        ready_s = time.perf_counter() - started
        url = gateway.url + "/v1/chat/completions"
        latencies = [post_ms(url, agent_body(rng, system_words)) for _ in range(REQUESTS_PER_ROUND)]
    finally:
        gateway.stop()
    first, rest = latencies[0], statistics.median(latencies[1:])
    return {"first_ms": first, "next_ms": rest, "first_extra_ms": first - rest, "ready_s": ready_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", default=None, help="source tree of a baseline gateway, started alternately")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--system-words", type=int, default=1500)
    args = parser.parse_args()
    rng = random.Random(0)
    trees: dict[str, str | None] = {"gateway": None}
    if args.baseline:
        trees["baseline"] = args.baseline
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    worker, worker_url = start_worker(1000)
    try:
        for round_no in range(args.rounds):
            order = list(trees) if round_no % 2 == 0 else list(reversed(trees))
            for name in order:
                run = one_start(worker_url, trees[name], rng, args.system_words)
                runs[name].append(run)
                print(f"round {round_no} {name:8s} " + "  ".join(f"{k} {v:.3f}" for k, v in run.items()), flush=True)
    finally:
        worker.stop()
    summary: dict[str, object] = {"rounds": args.rounds, "system_words": args.system_words}
    for name, values in runs.items():
        prefix = "" if name == "gateway" else "baseline_"
        for key in values[0]:
            summary[prefix + key] = round(statistics.median(v[key] for v in values), 3)
            summary[prefix + key + "_rounds"] = [round(v[key], 3) for v in values]
    if args.baseline:
        base = float(summary["baseline_first_extra_ms"])  # type: ignore[arg-type]
        summary["first_extra_ratio"] = round(float(summary["first_extra_ms"]) / base, 3) if base > 0 else None  # type: ignore[arg-type]
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
