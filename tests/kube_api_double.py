"""A Kubernetes API server double for the discovery tests: real HTTPS on loopback (a throwaway
CA and certificate from trustme), bearer-token checked, answering the requests a pool follower
makes with the API server's own wire format (kubernetes.io docs, "API concepts": a list's
metadata.resourceVersion, watch streams as one JSON event a line, BOOKMARK events, 410 Gone as
an ERROR event carrying a Status). No real kube-apiserver runs here: this is the gap it stands
in for (docs/deploy.md). Its state is changed from any thread; each change is one event to the
watches open on it, with a new resourceVersion, as etcd numbers them."""

from __future__ import annotations

import asyncio
import copy
import json
import ssl
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trustme
from aiohttp import web

from harness.launch import free_port

NAMESPACE = "ns"
POOL = "deepseek-flash"
LABELS = {"app.kubernetes.io/name": "deepinfer-gateway", "deepinfer.ai/inference-pool": POOL}
POOLS_PATH = f"/apis/inference.networking.k8s.io/v1/namespaces/{NAMESPACE}/inferencepools"
PODS_PATH = f"/api/v1/namespaces/{NAMESPACE}/pods"


def inference_pool(port: int, labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
            "metadata": {"name": POOL, "namespace": NAMESPACE, "uid": "pool-uid"},
            "spec": {"selector": {"matchLabels": labels or LABELS}, "targetPorts": [{"number": port}],
                     "endpointPickerRef": {"name": "epp", "port": {"number": 9002}, "failureMode": "FailClose"}}}


def pod(name: str, ip: str, ready: bool = True, labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": NAMESPACE, "uid": f"uid-{name}", "labels": labels or LABELS},
            "spec": {"containers": [{"name": "worker", "ports": [{"containerPort": 8100, "name": "worker"}]}]},
            "status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}],
                       "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


@dataclass
class Seen:
    method: str
    path: str
    query: dict[str, str]
    authorization: str


@dataclass
class _Watch:
    path: str
    selector: str  # labelSelector, or the fieldSelector metadata.name=...
    queue: asyncio.Queue[dict[str, Any] | None] = field(default_factory=asyncio.Queue)


class FakeApiServer:
    def __init__(self, tmp: Path, token: str = "token-1"):
        self.ca = trustme.CA()
        self.ca_file = tmp / "ca.crt"
        self.ca.cert_pem.write_to_path(str(self.ca_file))
        self.token_file = tmp / "token"
        self.token_file.write_text(token + "\n")
        self.tokens = {token}  # accepted
        self.port = free_port()
        self.url = f"https://127.0.0.1:{self.port}"
        self.version = 100
        self.oldest = 0  # a watch from before this version is answered 410
        self.pool: dict[str, Any] | None = None
        self.pods: dict[str, dict[str, Any]] = {}
        self.fail_lists = 0  # answer the next N lists 500
        self.gone_as_status = False  # a watch from too old a version: 410 status, else a 200 with an ERROR event
        self.seen: list[Seen] = []
        self._watches: list[_Watch] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None

    # -------------------------------------------------------------- running it

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        app = web.Application()
        app.router.add_get(POOLS_PATH, self._pools)
        app.router.add_get(POOLS_PATH + "/{name}", self._pool)
        app.router.add_get(PODS_PATH, self._pods)
        tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.ca.issue_cert("127.0.0.1").configure_cert(tls)
        # handler_cancellation: a watch the client left ends, as the API server ends it
        self._runner = web.AppRunner(app, shutdown_timeout=0.5, handler_cancellation=True)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port, ssl_context=tls).start()

    async def stop(self) -> None:
        for watch in self._watches:
            watch.queue.put_nowait(None)
        if self._runner is not None:
            await self._runner.cleanup()

    @contextmanager
    def in_thread(self) -> Iterator[FakeApiServer]:
        """Serve from a thread of its own (for a gateway or EPP child process to reach)."""
        started = threading.Event()
        loop = asyncio.new_event_loop()

        def run() -> None:
            asyncio.set_event_loop(loop)
            loop.run_until_complete(self.start())
            started.set()
            loop.run_forever()

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        assert started.wait(15)
        try:
            yield self
        finally:
            asyncio.run_coroutine_threadsafe(self.stop(), loop).result(10)
            loop.call_soon_threadsafe(loop.stop)
            self._thread.join(10)

    def _call(self, fn: Any, *args: Any) -> None:
        """Run a change on the server's loop (from the test's thread or loop alike)."""
        assert self._loop is not None
        if self._thread is None:
            fn(*args)
        else:
            asyncio.run_coroutine_threadsafe(self._async(fn, *args), self._loop).result(10)

    @staticmethod
    async def _async(fn: Any, *args: Any) -> None:
        fn(*args)

    # -------------------------------------------------------------- changes

    def set_pool(self, obj: dict[str, Any] | None) -> None:
        self._call(self._set_pool, obj)

    def set_pod(self, obj: dict[str, Any]) -> None:
        self._call(self._set_pod, obj)

    def delete_pod(self, name: str) -> None:
        self._call(self._delete_pod, name)

    def compact(self, silently_deleted: str | None = None) -> None:
        """The server forgets history (etcd compaction): every open watch gets 410 and ends; a
        pod deleted meanwhile is seen only by a new list."""
        self._call(self._compact, silently_deleted)

    def bookmark(self) -> None:
        self._call(self._bookmark)

    def end_watches(self, compact: bool = False, gone_as_status: bool = False) -> None:
        """The server ends every open watch as its timeoutSeconds does (a clean end); with
        `compact`, history is forgotten meanwhile, so resuming from the last version seen is
        answered 410: as an ERROR event, or with `gone_as_status` as the HTTP status."""
        self._call(self._end_watches, compact, gone_as_status)

    def _next(self, obj: dict[str, Any]) -> dict[str, Any]:
        self.version += 1
        obj = copy.deepcopy(obj)
        obj["metadata"]["resourceVersion"] = str(self.version)
        return obj

    def _set_pool(self, obj: dict[str, Any] | None) -> None:
        old = self.pool
        self.pool = None if obj is None else self._next(obj)
        if self.pool is not None:
            self._send(POOLS_PATH, self.pool, "ADDED" if old is None else "MODIFIED")
        elif old is not None:
            self._send(POOLS_PATH, self._next(old), "DELETED")

    def _set_pod(self, obj: dict[str, Any]) -> None:
        name = obj["metadata"]["name"]
        kind = "MODIFIED" if name in self.pods else "ADDED"
        self.pods[name] = self._next(obj)
        self._send(PODS_PATH, self.pods[name], kind)

    def _delete_pod(self, name: str) -> None:
        self._send(PODS_PATH, self._next(self.pods.pop(name)), "DELETED")

    def _compact(self, silently_deleted: str | None) -> None:
        if silently_deleted is not None:
            self.pods.pop(silently_deleted)
        self.version += 1
        self.oldest = self.version
        for watch in self._watches:
            watch.queue.put_nowait(self._gone())
            watch.queue.put_nowait(None)

    def _end_watches(self, compact: bool, gone_as_status: bool) -> None:
        if compact:
            self.version += 1
            self.oldest = self.version
        self.gone_as_status = gone_as_status
        for watch in self._watches:
            watch.queue.put_nowait(None)

    def _bookmark(self) -> None:
        self.version += 1
        for watch in self._watches:
            watch.queue.put_nowait({"type": "BOOKMARK", "object": {
                "kind": "Pod", "apiVersion": "v1", "metadata": {"resourceVersion": str(self.version)}}})

    def _gone(self) -> dict[str, Any]:
        return {"type": "ERROR", "object": {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                                            "message": f"too old resource version: (oldest {self.oldest})",
                                            "reason": "Expired", "code": 410}}

    def _send(self, path: str, obj: dict[str, Any], kind: str) -> None:
        for watch in self._watches:
            if watch.path == path and self._matches(watch.selector, obj):
                watch.queue.put_nowait({"type": kind, "object": obj})

    @staticmethod
    def _matches(selector: str, obj: dict[str, Any]) -> bool:
        if selector.startswith("metadata.name="):
            return bool(obj["metadata"]["name"] == selector.split("=", 1)[1])
        labels = obj["metadata"].get("labels", {})
        wanted = dict(term.split("=", 1) for term in selector.split(",") if term)
        return all(labels.get(k) == v for k, v in wanted.items())

    # -------------------------------------------------------------- answers

    def _authorized(self, request: web.Request) -> None:
        auth = request.headers.get("Authorization", "")
        self.seen.append(Seen(request.method, request.path, dict(request.query), auth))
        if auth.removeprefix("Bearer ") not in self.tokens:
            raise web.HTTPUnauthorized(text=json.dumps({"kind": "Status", "code": 401, "reason": "Unauthorized"}),
                                       content_type="application/json")

    async def _pool(self, request: web.Request) -> web.Response:
        self._authorized(request)
        if self.pool is None or request.match_info["name"] != POOL:
            raise web.HTTPNotFound(text=json.dumps({"kind": "Status", "code": 404, "reason": "NotFound"}),
                                   content_type="application/json")
        return web.json_response(self.pool)

    async def _pools(self, request: web.Request) -> web.StreamResponse:
        self._authorized(request)
        assert request.query.get("watch") == "1", "the follower only gets its pool, and watches it"
        return await self._watch(request, POOLS_PATH, request.query["fieldSelector"],
                                 [self.pool] if self.pool is not None else [])

    async def _pods(self, request: web.Request) -> web.StreamResponse:
        self._authorized(request)
        selector = request.query.get("labelSelector", "")
        items = [p for p in self.pods.values() if self._matches(selector, p)]
        if request.query.get("watch") == "1":
            return await self._watch(request, PODS_PATH, selector, items)
        if self.fail_lists:
            self.fail_lists -= 1
            raise web.HTTPInternalServerError(text="etcdserver: request timed out")
        return web.json_response({"kind": "PodList", "apiVersion": "v1",
                                  "metadata": {"resourceVersion": str(self.version)}, "items": items})

    async def _watch(self, request: web.Request, path: str, selector: str,
                     existing: list[dict[str, Any]]) -> web.StreamResponse:
        since = request.query.get("resourceVersion")
        too_old = since is not None and int(since) < self.oldest
        if too_old and self.gone_as_status:
            raise web.HTTPGone(text=json.dumps(self._gone()["object"]), content_type="application/json")
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        if too_old:
            await response.write(json.dumps(self._gone()).encode() + b"\n")
            return response
        watch = _Watch(path, selector)
        if since is None:  # "start at most recent": the objects that exist first, as ADDED
            for obj in existing:
                watch.queue.put_nowait({"type": "ADDED", "object": obj})
        self._watches.append(watch)
        try:
            while (event := await watch.queue.get()) is not None:
                await response.write(json.dumps(event).encode() + b"\n")
        finally:
            self._watches.remove(watch)
        return response

    def watches(self, path: str) -> int:
        return sum(1 for w in self._watches if w.path == path)
