"""What a sim worker's OpenAI-compatible render endpoint costs per long chat prompt.

    python bench/compat_render.py [--tokens 11000] [--prompts 20] [--workers 4]

Peer routers ask the workers to render and tokenize each request before choosing one
(vLLM's router calls `/v1/chat/completions/render` on every worker), so this cost is paid
once per worker per request. One `sim-cluster` child process with `--workers` sim workers
(as bench/peers.py runs them); over HTTP, for `--prompts` distinct one-message prompts of
`--tokens` tokens (the load generator's prompt synthesis, like a Mooncake request):

- `first_render`: the first worker renders each new prompt (nothing cached yet);
- `other_renders`: every other worker renders the same body (what a router that renders
  on all workers adds);
- `chat_convert`: the same body once more, as the chat request that follows would convert it.

Figure: the sim-cluster process's CPU (utime + stime from /proc) per call, in ms; the last
line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # harness/, at the repository root
from deepinfer_gateway.core.protocol import DEFAULT_MODEL
from deepinfer_gateway.workload.synthesis import PromptSynthesizer
from deepinfer_gateway.workload.types import MOONCAKE_BLOCK_TOKENS, TraceRequest
from harness.launch import SimCluster


def process_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def post(url: str, body: bytes) -> dict[str, object]:
    request = urllib.request.Request(url, data=body, headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        answer: dict[str, object] = json.load(response)
        return answer


def bodies(tokens: int, prompts: int) -> list[bytes]:
    synthesizer = PromptSynthesizer.for_default_tokenizer()
    blocks = -(-tokens // MOONCAKE_BLOCK_TOKENS)
    out = []
    for i in range(prompts):
        request = TraceRequest(i, 0.0, tokens, 1, tuple(range(i * blocks, (i + 1) * blocks)))
        message = {"role": "user", "content": synthesizer.content(request)}
        out.append(json.dumps({"model": DEFAULT_MODEL, "messages": [message]}).encode())
    return out


def measure(tokens: int, prompts: int, workers: int) -> dict[str, float | int]:
    cluster = SimCluster(",".join(["unified:sm100"] * workers), time_scale=1000.0)
    pid = cluster.proc.proc.pid
    renders = [url + "/v1/chat/completions/render" for url in cluster.urls]
    try:
        warm = bodies(200, 1)[0]
        for url in renders:
            post(url, warm)  # tokenizer, encoder and routes loaded before anything is timed
        cpu = {"first_render": 0.0, "other_renders": 0.0, "chat_convert": 0.0}
        calls = {"first_render": 0, "other_renders": 0, "chat_convert": 0}
        prompt_tokens = 0
        for body in bodies(tokens, prompts):
            steps = [("first_render", renders[0])] + [("other_renders", u) for u in renders[1:]]
            steps.append(("chat_convert", renders[0]))
            for name, url in steps:
                before = process_cpu_s(pid)
                reply = post(url, body)
                cpu[name] += process_cpu_s(pid) - before
                calls[name] += 1
            prompt_tokens = int(reply["count"])  # type: ignore[call-overload]
    finally:
        cluster.stop()
    result: dict[str, float | int] = {"prompt_tokens": prompt_tokens, "prompts": prompts, "workers": workers}
    for name, seconds in cpu.items():
        result[f"{name}_cpu_ms"] = round(1000 * seconds / max(1, calls[name]), 2)
    result["per_request_all_workers_cpu_ms"] = round(
        result["first_render_cpu_ms"] + (workers - 1) * result["other_renders_cpu_ms"], 2)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=11000, help="prompt tokens of each request (default 11000)")
    parser.add_argument("--prompts", type=int, default=20, help="distinct prompts rendered (default 20)")
    parser.add_argument("--workers", type=int, default=4, help="sim workers in the cluster process (default 4)")
    args = parser.parse_args()
    started = time.monotonic()
    result = measure(args.tokens, args.prompts, args.workers)
    for key, value in result.items():
        print(f"{key:34s} {value}")
    print(f"{'wall_s':34s} {time.monotonic() - started:.1f}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
