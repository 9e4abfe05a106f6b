"""Misbehaving workers for the fault tests: real HTTP servers in their own processes.

Two kinds, both started with `FaultyWorker(mode, ...)` (a `launch.Proc` underneath):

- a double (aiohttp) that speaks just enough of docs/worker-protocol.md (info, load,
  health, generate, abort; with `protocol="v2"` the v2 connection too, else its upgrade
  is answered 404 as by a v1-only worker) and misbehaves on generate as `mode` says, over
  whichever protocol the gateway chose; its load report counts the generate calls still
  open, so "no engine request leaked" is checkable the same way as on a sim worker;
- the real sim engine with its failure knobs (`sim-hang`: accepts, never steps;
  `sim-fail-after`: an `engine` error finish after N tokens).

Double modes (generate): `ok` (ready, N one-token messages, finish), `hang-before-ready`,
`hang-after` (ready + K tokens, then nothing), `garbage-before` (ready, then a non-JSON
line), `garbage-after` (K tokens, then a non-JSON line), `html` (200 with an HTML page),
`reset-after` (K tokens, then the TCP connection is aborted: a crash as seen from the
socket), `http-500`, `bad-ready` (a ready event without its cached-token counts: a worker
of another protocol version, which the gateway does not expect). Over v2 a request's events
are its own messages and garbage is a whole message that is not JSON (which ends the
connection, as a worker's bad message does); `html` and `http-500` are answers to a v1
generate call, so v1 only.

    python -m tests.fault_doubles --port 9001 --mode hang-after --after 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from deepinfer_gateway.core import protocol as wp
from harness.launch import Proc, free_port, wait_for_port

DOUBLE_MODES = ("ok", "hang-before-ready", "hang-after", "garbage-before", "garbage-after", "html", "reset-after",
                "http-500", "bad-ready")
V1_ONLY_MODES = ("html", "http-500")
SIM_MODES = ("sim-hang", "sim-fail-after")
PROTOCOLS = ("v1", "v2")


class FaultyWorker:
    """A misbehaving worker process on a free loopback port."""

    def __init__(self, mode: str, *, after: int = 3, tokens: int = 20, delay_ms: float = 5.0,
                 hardware: str = "sm100", time_scale: float = 20.0, protocol: str = "v1"):
        """`protocol`: "v2" for a double that serves the v2 connection (the sim modes always do)."""
        assert mode in DOUBLE_MODES + SIM_MODES and protocol in PROTOCOLS, (mode, protocol)
        assert protocol == "v1" or mode not in V1_ONLY_MODES, f"{mode} is a v1 generate answer"
        self.mode = mode
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.hardware = hardware
        self.proc = Proc([sys.executable, "-m", "tests.fault_doubles", "--port", str(self.port), "--mode", mode,
                          "--after", str(after), "--tokens", str(tokens), "--delay-ms", str(delay_ms),
                          "--hardware", hardware, "--time-scale", str(time_scale), "--protocol", protocol])
        wait_for_port(self.port, timeout=30)

    def spec(self) -> tuple[str, str, str]:
        return (self.url, "unified", self.hardware)

    def load(self) -> dict[str, Any]:
        with urllib.request.urlopen(self.url + wp.LOAD_PATH, timeout=5) as r:
            return dict(json.load(r))

    def seen(self) -> list[dict[str, Any]]:
        """Double only: the generate calls received: request id (v1: header and body), traceparent,
        and `via`, the protocol that carried it."""
        with urllib.request.urlopen(self.url + "/test/seen", timeout=5) as r:
            return list(json.load(r))

    def stop(self) -> None:
        self.proc.kill()


# --- client-side helpers ----------------------------------------------------------------


def scrape(gateway_url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The gateway's /metrics as {(sample name, sorted labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(gateway_url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def total(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    """Sum of `name` samples whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= set(ls))


async def until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    """Await `cond()` becoming true, checking every 10 ms; AssertionError after `timeout` seconds."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.01)


def scrape_until(gateway_url: str, name: str, want: float,
                 **labels: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Scrape until `name` reaches `want` (a request is counted when its response closes), for 10 s at most."""
    deadline = time.monotonic() + 10
    while True:
        samples = scrape(gateway_url)
        if total(samples, name, **labels) >= want or time.monotonic() > deadline:
            return samples
        time.sleep(0.05)


@dataclass
class Outcome:
    """How one streamed answer ended, as the client saw it."""

    status: int
    kind: str = ""  # done | error | truncated | http_error | client_gone
    text: str = ""
    frames: list[dict[str, Any]] = field(default_factory=list)


async def stream_chat(session: Any, url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> Outcome:
    """POST a streaming chat completion and classify its end: `[DONE]` / error frame / silent truncation."""
    async with session.post(url + "/v1/chat/completions", json={**body, "stream": True}, headers=headers) as r:
        if r.status != 200:
            return Outcome(r.status, "http_error", (await r.read()).decode(errors="replace"))
        out = Outcome(r.status, "truncated")
        async for raw in r.content:
            line = raw.strip()
            if not line.startswith(b"data: "):
                continue
            data = line[6:]
            if data == b"[DONE]":
                out.kind = "done"
                break
            frame = json.loads(data)
            out.frames.append(frame)
            if "error" in frame:
                out.kind = "error"
                continue
            for choice in frame.get("choices", ()):
                out.text += choice.get("delta", {}).get("content") or ""
        return out


def wait_idle(workers: list[Any], timeout: float = 15.0) -> list[dict[str, Any]]:
    """Poll until every worker's load report says running == waiting == 0; returns the last reports."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        loads = [w.load() for w in workers]
        if all(x["running"] == 0 and x["waiting"] == 0 for x in loads) or time.monotonic() > deadline:
            return loads
        time.sleep(0.05)


# --- the double -----------------------------------------------------------------------


def _line(event: dict[str, Any]) -> bytes:
    return json.dumps(event).encode() + b"\n"


HANG, RESET = "hang", "reset"  # steps of a script besides events (dicts) and garbage (bytes)


async def play(mode: str, prompt_tokens: int, after: int, tokens: int, delay_s: float,
               word: list[int]) -> AsyncIterator[dict[str, Any] | bytes | str]:
    """One generate call's misbehaviour as steps, whichever protocol carries them."""
    if mode == "hang-before-ready":
        yield HANG
        return
    ready = wp.ready_event(prompt_tokens, 0, 0)
    if mode == "bad-ready":
        del ready["cached_tokens"]
    yield ready
    if mode == "garbage-before":
        yield b"<html>this is not json</html>"
        return
    n = tokens if mode == "ok" else after
    for _ in range(n):
        await asyncio.sleep(delay_s)
        yield wp.tokens_event(word)
    if mode == "hang-after":
        yield HANG
    elif mode == "garbage-after":
        yield b'{"event": "tokens", "token_ids": [1, 2'
    elif mode == "reset-after":
        yield RESET
    else:
        yield wp.finish_event(wp.FinishReason.LENGTH, num_output_tokens=n)


def make_double(mode: str, after: int, tokens: int, delay_s: float, hardware: str, protocol: str = "v1") -> Any:
    from aiohttp import WSMsgType, web

    from deepinfer_gateway.recipe_bridge.tokenizer import load_tokenizer

    word = list(load_tokenizer().tokenizer.encode(" lorem"))[:1]
    worker_id = f"double-{mode}"
    epoch = "double-epoch"
    open_calls: set[int] = set()
    seen: list[dict[str, Any]] = []

    async def info(_: web.Request) -> web.Response:
        return web.json_response(wp.WorkerInfo(worker_id=worker_id, engine="sim", role=wp.Role.UNIFIED,
                                               hardware=wp.Hardware(hardware), kv_format=f"double/{hardware}",
                                               model="DeepSeek-V4.1-Flash", epoch=epoch).model_dump(mode="json"))

    async def load(_: web.Request) -> web.Response:
        n = len(open_calls)
        return web.json_response(wp.LoadReport(
            worker_id=worker_id, role=wp.Role.UNIFIED, hardware=wp.Hardware(hardware), kv_format=f"double/{hardware}",
            running=n, waiting=0, queued_prefill_tokens=0, kv_usage=0.0, memory_capacity_blocks=1000,
            dp_ranks=[wp.DpRankLoad(dp_rank=0, running=n, waiting=0, queued_prefill_tokens=0)], epoch=epoch,
        ).model_dump(mode="json"))

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "epoch": epoch})

    async def abort(_: web.Request) -> web.Response:
        return web.json_response({"aborted": False})

    async def kv_events(_: web.Request) -> web.Response:
        return web.json_response({"worker_id": worker_id, "epoch": epoch, "events": [], "last_seq": 0,
                                  "oldest_seq": 1})

    async def seen_calls(_: web.Request) -> web.Response:
        return web.json_response(seen[-1000:])

    async def generate(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen.append({"request_id": request.headers.get(wp.REQUEST_ID_HEADER), "body_request_id": body["request_id"],
                     "traceparent": request.headers.get("traceparent"), "via": "v1"})
        if mode == "http-500":
            return web.json_response({"error": {"kind": "engine", "message": "boom"}}, status=500)
        if mode == "html":
            return web.Response(text="<html><body>502 Bad Gateway</body></html>", content_type="text/html")
        key = id(request)
        open_calls.add(key)
        try:
            resp = web.StreamResponse(headers={"content-type": wp.NDJSON})
            await resp.prepare(request)
            async for step in play(mode, len(body["token_ids"]), after, tokens, delay_s, word):
                if isinstance(step, dict):
                    await resp.write(_line(step))
                elif isinstance(step, bytes):
                    await resp.write(step + b"\n")
                    return resp
                elif step == RESET:
                    assert request.transport is not None
                    request.transport.abort()
                    return resp
                else:
                    await asyncio.Event().wait()
            await resp.write_eof()
            return resp
        finally:
            open_calls.discard(key)

    async def mux(request: web.Request) -> web.WebSocketResponse:
        """v2: each generate op plays its script as its own messages on the one connection."""
        ws = web.WebSocketResponse(max_msg_size=wp.MAX_MUX_MESSAGE_BYTES)
        await ws.prepare(request)
        running: dict[str, asyncio.Task[None]] = {}

        async def run(rid: str, prompt_tokens: int) -> None:
            key = id(asyncio.current_task())
            open_calls.add(key)
            try:
                async for step in play(mode, prompt_tokens, after, tokens, delay_s, word):
                    if isinstance(step, dict):
                        await ws.send_bytes(json.dumps([[rid, step]]).encode())
                    elif isinstance(step, bytes):
                        await ws.send_bytes(step)
                        return
                    elif step == RESET:
                        assert request.transport is not None
                        request.transport.abort()
                        return
                    else:
                        await asyncio.Event().wait()
            except ConnectionError:
                pass  # the connection went: nothing more to say on it
            finally:
                open_calls.discard(key)
                running.pop(rid, None)

        try:
            async for msg in ws:
                if msg.type not in (WSMsgType.BINARY, WSMsgType.TEXT):
                    continue
                for op in json.loads(msg.data):
                    if op["op"] == "generate":
                        rid = op["request"]["request_id"]
                        seen.append({"request_id": rid, "body_request_id": rid, "via": "v2",
                                     "traceparent": (op.get("trace") or {}).get("traceparent")})
                        running[rid] = asyncio.create_task(run(rid, len(op["request"]["token_ids"])))
                    elif op["op"] == "abort" and (task := running.pop(op["request_id"], None)) is not None:
                        task.cancel()
        finally:
            for task in list(running.values()):
                task.cancel()  # a closed connection aborts everything on it
        return ws

    app = web.Application()
    app.router.add_get(wp.INFO_PATH, info)
    app.router.add_get(wp.LOAD_PATH, load)
    app.router.add_get(wp.HEALTH_PATH, health)
    app.router.add_post(wp.ABORT_PATH, abort)
    app.router.add_post(wp.GENERATE_PATH, generate)
    app.router.add_get(wp.KV_EVENTS_PATH, kv_events)
    app.router.add_get("/test/seen", seen_calls)
    if protocol == "v2":
        app.router.add_get(wp.MUX_PATH, mux)
    return app


async def _serve_double(args: argparse.Namespace) -> None:
    from aiohttp import web

    app = make_double(args.mode, args.after, args.tokens, args.delay_ms / 1000, args.hardware, args.protocol)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", args.port).start()
    await asyncio.Event().wait()


async def _serve_sim(args: argparse.Namespace) -> None:
    from deepinfer_gateway.core.protocol import Role
    from deepinfer_gateway.workers.sim.cluster import SimWorkerSpec, serve_sim_cluster
    from deepinfer_gateway.workers.sim.engine import Failures

    failures = Failures(hang=True) if args.mode == "sim-hang" else Failures(fail_after_tokens=args.after)
    spec = SimWorkerSpec(f"{args.mode}-{args.port}", Role.UNIFIED, args.hardware, args.port, args.time_scale,
                         failures=failures)
    await serve_sim_cluster([spec], with_store=False)
    await asyncio.Event().wait()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--mode", choices=DOUBLE_MODES + SIM_MODES, required=True)
    parser.add_argument("--after", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=20)
    parser.add_argument("--delay-ms", type=float, default=5.0)
    parser.add_argument("--hardware", default="sm100")
    parser.add_argument("--time-scale", type=float, default=20.0)
    parser.add_argument("--protocol", choices=PROTOCOLS, default="v1")
    args = parser.parse_args()
    asyncio.run(_serve_sim(args) if args.mode in SIM_MODES else _serve_double(args))


if __name__ == "__main__":
    main()
