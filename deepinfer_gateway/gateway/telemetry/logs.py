"""Structured logs: one JSON object per line, every line of a request tagged with its id.

The request id is the client's `x-request-id` when it sent one (1..128 printable ASCII
characters), otherwise a fresh uuid4 hex. It lives in a context variable for the life of
the request, so every log line emitted while serving it (the request path's warnings,
the worker client, the rate limiter) carries `request_id` without being passed it, and
it is returned in the `x-request-id` response header and sent to the worker in the
generate call's headers (the app reads it from the request headers, where
`RequestContext` has put it).

    configure_logging("info", "json")             # cli: --log-format json / DGW_LOG_FORMAT=json
    app = RequestContext(create_app(settings))   # request id + one access line per request

`RequestContext` is a pure ASGI middleware (no Starlette BaseHTTPMiddleware: that one
runs the app in another task and costs ~100 us per request). Its access line, logger
`deepinfer_gateway.access` at INFO, has: method, path, status, duration_ms (to the last
byte), worker (the `x-dgw-worker` response header when the app set one), and
`client_gone` when the client disconnected before the end of the response.

Cost: ~15 us per request for the access line in JSON (measured with bench/gateway_capacity.py
--profile); set the access logger to WARNING to drop it.
"""

from __future__ import annotations

import contextvars
import logging
import os
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeGuard

import orjson

from deepinfer_gateway.core import headers

REQUEST_ID_HEADER = headers.REQUEST_ID
_HEADER_BYTES = REQUEST_ID_HEADER.encode()
_WORKER_HEADER = headers.WORKER.encode()
LOG_FORMATS = ("text", "json")

request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("dgw_request_id", default=None)
access_log = logging.getLogger("deepinfer_gateway.access")


def random_id() -> str:
    """A fresh request or response id: 128 random bits as 32 hex digits (uuid4().hex's form
    without building a UUID object, ~2 us less per id)."""
    return os.urandom(16).hex()


# LogRecord attributes that are not `extra=` fields.
_RESERVED = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}


def current_request_id() -> str | None:
    return request_id_var.get()


@contextmanager
def bound_request_id(request_id: str) -> Iterator[None]:
    """Tag every log line inside the block with `request_id` (for code outside a request, e.g. tests)."""
    token = request_id_var.set(request_id)
    try:
        yield
    finally:
        request_id_var.reset(token)


def valid_request_id(value: str | None) -> TypeGuard[str]:
    return value is not None and 0 < len(value) <= 128 and value.isascii() and value.isprintable()


class JsonFormatter(logging.Formatter):
    """`{"ts", "level", "logger", "msg", "request_id"?, ...extra fields, "exc"?}` on one line."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        rid = getattr(record, "request_id", None) or request_id_var.get()
        if rid:
            out["request_id"] = rid
        for key, value in record.__dict__.items():
            if key not in _RESERVED and key not in out:
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(out, default=str).decode()


class _TextRequestIdFilter(logging.Filter):
    """Text format: `[request_id]` after the level when a request is in scope."""

    def filter(self, record: logging.LogRecord) -> bool:
        rid = getattr(record, "request_id", None) or request_id_var.get()
        record.rid = f" [{rid}]" if rid else ""
        return True


def configure_logging(level: str = "info", fmt: str = "text", stream: Any = None) -> None:
    """Root logging for a gateway/worker process. `fmt`: "text" (human) or "json" (one object per line)."""
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {LOG_FORMATS}, not {fmt!r}")
    handler = logging.StreamHandler(stream or sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.addFilter(_TextRequestIdFilter())
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s%(rid)s %(name)s: %(message)s"))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    if fmt == "json":  # uvicorn's own loggers carry their own handlers: route them through ours
        for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
            lg = logging.getLogger(name)
            lg.handlers.clear()
            lg.propagate = True


class RequestContext:
    """ASGI middleware: request id (context variable, request header, response header) + access line."""

    def __init__(self, app: Any, *, access: bool = True):
        self.app = app
        self.access = access

    def __getattr__(self, name: str) -> Any:  # `state`, `router`... of the wrapped app
        return getattr(self.app, name)

    async def __call__(self, scope: dict[str, Any], receive: Any,
                       send: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers: list[tuple[bytes, bytes]] = scope["headers"]
        rid = None
        for name, value in headers:
            if name == _HEADER_BYTES:
                rid = value.decode("latin-1")
                break
        if not valid_request_id(rid):
            rid = random_id()
            scope = dict(scope)
            scope["headers"] = [(n, v) for n, v in headers if n != _HEADER_BYTES] + [(_HEADER_BYTES, rid.encode())]
        token = request_id_var.set(rid)
        started = time.perf_counter()
        status = 0
        worker = None
        finished = False
        rid_bytes = rid.encode()

        # A plain function handing back `send`'s awaitable, not a coroutine of its own: a
        # stream sends one body message per relayed chunk, and this adds no frame to it.
        def send_wrapper(message: dict[str, Any]) -> Awaitable[None]:
            nonlocal status, worker, finished
            if message["type"] == "http.response.body":
                if not message.get("more_body", False):
                    finished = True
                return send(message)
            if message["type"] == "http.response.start":
                status = message["status"]
                out = list(message.get("headers", ()))
                has_rid = False
                for name, value in out:
                    if name == _HEADER_BYTES:
                        has_rid = True
                    elif name == _WORKER_HEADER:
                        worker = value.decode("latin-1")
                if not has_rid:
                    out.append((_HEADER_BYTES, rid_bytes))
                    message = {**message, "headers": out}
            return send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            request_id_var.reset(token)
            if self.access and access_log.isEnabledFor(logging.INFO):
                extra: dict[str, Any] = {
                    "request_id": rid, "method": scope["method"], "path": scope["path"], "status": status,
                    "duration_ms": round((time.perf_counter() - started) * 1000, 3),
                }
                if worker:
                    extra["worker"] = worker
                if not finished:
                    extra["client_gone"] = True
                access_log.info("%s %s %s", scope["method"], scope["path"], status, extra=extra)
