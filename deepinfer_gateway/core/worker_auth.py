"""The shared token between the gateway and its workers: read, rotated, checked.

A worker serves its engine endpoints only to a caller that presents `Authorization: Bearer
<token>` (the header vLLM's `--api-key` checks too, so one token serves every engine). The
token comes from `DGW_WORKER_TOKEN`, or from the file named by `DGW_WORKER_TOKEN_FILE` (a
mounted Kubernetes Secret): one token per line, blank lines and `#` comments ignored. A
worker accepts any token of the file and the gateway sends the first, so a rotation never
drops a call: add the new token as a second line (workers now accept both), make it the
first line (gateways now send it), then remove the old one. The file is re-read when its
modification time changes, checked at most once per `recheck_s`; a Secret update reaches
the pods without a restart.

Without a token a worker serves anyone, which `check_bind` allows only on loopback: a
worker that listens beyond it without a token refuses to start.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import orjson

from deepinfer_gateway.core.protocol import HEALTH_PATH

TOKEN_ENV = "DGW_WORKER_TOKEN"
TOKEN_FILE_ENV = "DGW_WORKER_TOKEN_FILE"
# Probes reach these without a token; they start no engine work.
OPEN_PATHS = frozenset({HEALTH_PATH})

log = logging.getLogger(__name__)


class TokenError(ValueError):
    """No usable token where one was asked for (an empty or unreadable file)."""


def parse_tokens(text: str) -> tuple[str, ...]:
    """The tokens of a token file: one per line; blank lines and `#` comments skipped."""
    lines = (line.strip() for line in text.splitlines())
    return tuple(line for line in lines if line and not line.startswith("#"))


class SecretTokens:
    """Tokens given directly (`value`: one token, or several one per line) or read from `path`,
    re-read when the file changes. `current()`: the one to send; `accepts()`: the check."""

    def __init__(self, value: str | None = None, path: str | Path | None = None, recheck_s: float = 1.0):
        if (value is None) == (path is None):
            raise ValueError("give a token or a token file, not both")
        self._path = Path(path) if path is not None else None
        self._recheck_s = recheck_s
        self._checked_at = 0.0
        self._mtime: int | None = None
        self._tokens: tuple[str, ...] = parse_tokens(value) if value is not None else ()
        self._encoded = tuple(t.encode() for t in self._tokens)
        self.refresh(force=True)

    @property
    def source(self) -> str:
        return str(self._path) if self._path is not None else "the environment"

    def refresh(self, force: bool = False) -> None:
        """Re-read the file if it changed (at most once per recheck_s unless forced). A file
        that became unreadable or empty keeps the last tokens, logged: a half-written Secret
        update must not lock the gateway out of its workers."""
        if self._path is None:
            if not self._tokens:
                raise TokenError(f"{TOKEN_ENV} is empty")
            return
        now = time.monotonic()
        if not force and now - self._checked_at < self._recheck_s:
            return
        self._checked_at = now
        try:
            mtime = self._path.stat().st_mtime_ns
            if mtime == self._mtime:
                return
            tokens = parse_tokens(self._path.read_text())
        except OSError as e:
            if force and not self._tokens:
                raise TokenError(f"cannot read the token file {self._path}: {e.strerror or e}") from None
            log.error("token file %s unreadable (%s): keeping the previous tokens", self._path, e)
            return
        if not tokens:
            if force and not self._tokens:
                raise TokenError(f"the token file {self._path} holds no token")
            log.error("token file %s holds no token: keeping the previous tokens", self._path)
            return
        if self._tokens and tokens != self._tokens:
            log.info("token file %s changed: %d token(s) now", self._path, len(tokens))
        self._mtime = mtime
        self._tokens = tokens
        self._encoded = tuple(t.encode() for t in tokens)

    def current(self) -> str:
        self.refresh()
        return self._tokens[0]

    def accepts(self, presented: bytes) -> bool:
        """Constant-time in the presented token: every accepted token is compared."""
        self.refresh()
        found = False
        for token in self._encoded:
            found |= hmac.compare_digest(presented, token)
        return found


def tokens_from(value: str | None, path: str | None, recheck_s: float = 1.0) -> SecretTokens | None:
    """The tokens of a setting pair (a value, or a file naming them); None when neither is set.
    The file wins when both are: it is the one a rotation updates."""
    if path:
        return SecretTokens(path=path, recheck_s=recheck_s)
    if value:
        return SecretTokens(value=value)
    return None


def worker_tokens_from_env(environ: Mapping[str, str] = os.environ) -> SecretTokens | None:
    return tokens_from(environ.get(TOKEN_ENV), environ.get(TOKEN_FILE_ENV))


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name: it may resolve beyond loopback
        return False


def check_bind(host: str, tokens: SecretTokens | None) -> None:
    """Refuse to serve beyond loopback without a token (SystemExit with what to set)."""
    if tokens is None and not is_loopback(host):
        raise SystemExit(f"a worker listening on {host} needs a token: set {TOKEN_ENV} or {TOKEN_FILE_ENV} "
                         "(the gateway sends the same), or listen on 127.0.0.1")


_UNAUTHORIZED = orjson.dumps({"error": {"kind": "unauthorized",
                                        "message": "missing or wrong worker token (Authorization: Bearer)"}})


class RequireWorkerToken:
    """ASGI middleware: every HTTP path and WebSocket (worker protocol v2) but OPEN_PATHS needs
    `Authorization: Bearer <token>` with a token `tokens` accepts; anything else gets 401 before
    the app sees the request (a WebSocket handshake: 401 where the server can send it, else 403)."""

    def __init__(self, app: Any, tokens: SecretTokens):
        self.app = app
        self.tokens = tokens

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        kind = scope["type"]
        if kind not in ("http", "websocket") or scope["path"] in OPEN_PATHS or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        prefix = "http"
        if kind == "websocket":  # worker protocol v2's connection: refused at the handshake
            await receive()  # websocket.connect
            if "websocket.http.response" not in scope.get("extensions", {}):
                await send({"type": "websocket.close", "code": 1008})  # the server answers 403
                return
            prefix = "websocket.http"
        await send({"type": f"{prefix}.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")]})
        await send({"type": f"{prefix}.response.body", "body": _UNAUTHORIZED})

    def _authorized(self, scope: Any) -> bool:
        return presents_token(self.tokens, scope["headers"])


def presents_token(tokens: SecretTokens, headers: Any) -> bool:
    """Whether ASGI `headers` (name, value byte pairs) carry `Authorization: Bearer` with a token
    `tokens` accepts now."""
    for name, value in headers:
        if name == b"authorization":
            scheme, _, presented = value.partition(b" ")
            return scheme.lower() == b"bearer" and tokens.accepts(presented.strip())
    return False


def bearer(tokens: SecretTokens | None) -> dict[str, str]:
    """The header a caller sends: the first token, or nothing without one."""
    return {"Authorization": f"Bearer {tokens.current()}"} if tokens is not None else {}
