"""The Kubernetes API server as kube_discovery.py reads it: GET an object or a list, and watch
a collection as a stream of JSON lines, over aiohttp.

- Access (`ApiAccess.of`): in a pod, https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT
  with the service account's token and CA (the files the kubelet mounts); a `[[discovery]]`
  entry may name another server, token file and CA (tests, a gateway outside the cluster).
- The token file is read before every request: the kubelet rotates bound tokens (about
  hourly) and a long-lived process must send the current one.
- Errors: `Expired` for 410 Gone (the resourceVersion asked from is no longer kept: list
  again), `ApiError` for any other answer but 200 and for transport failures (the caller
  backs off and retries), `NotFound` for 404.
- `Backoff`: exponential with full jitter between failed attempts, reset by a success.
"""

from __future__ import annotations

import os
import random
import ssl
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from deepinfer_gateway.config import DiscoverySpec
from deepinfer_gateway.config.models import KUBERNETES_SERVICE_ACCOUNT
from deepinfer_gateway.gateway.fleet.kube_pool import GONE, WatchEvent

REQUEST_TIMEOUT_S = 10.0  # a GET (a list of a pool's pods is small)
WATCH_TIMEOUT_S = 300  # the server ends each watch after this (timeoutSeconds); the client watches again
_WATCH_READ_MARGIN_S = 30.0  # a watch with no line (not even a bookmark) for longer is a dead connection
_LINE_BUFFER = 1024 * 1024  # aiohttp refuses a line over twice this: one event, a pod with its managed fields


class ApiError(Exception):
    """The API server could not answer this request (its status, or a transport failure)."""


class NotFound(ApiError):
    pass


class Expired(ApiError):
    """410 Gone: the resourceVersion is too old; list again."""


@dataclass(frozen=True)
class ApiAccess:
    base_url: str  # https://HOST:PORT, no trailing slash
    token_file: str  # empty: no Authorization header
    ca_file: str  # empty: the system's CAs
    namespace: str

    @classmethod
    def of(cls, found: DiscoverySpec, environ: Mapping[str, str] = os.environ) -> ApiAccess:
        """The entry's server, credentials and namespace; ValueError naming what is missing."""
        base = found.api_server.rstrip("/")
        if not base:
            host, port = environ.get("KUBERNETES_SERVICE_HOST"), environ.get("KUBERNETES_SERVICE_PORT")
            if not host or not port:
                raise ValueError(f'discovery {found.name!r}: kind = "kubernetes" outside a pod needs api_server '
                                 "(KUBERNETES_SERVICE_HOST/PORT are not set)")
            base = f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"
        namespace = found.namespace
        if not namespace:
            path = Path(KUBERNETES_SERVICE_ACCOUNT) / "namespace"
            try:
                namespace = path.read_text().strip()
            except OSError as exc:
                raise ValueError(f"discovery {found.name!r}: no namespace set and {path} unreadable: {exc}") from None
        return cls(base, found.token_file, found.ca_file, namespace)


class KubeApi:
    """One API server's client; `aclose` when done."""

    def __init__(self, access: ApiAccess):
        self.access = access
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:  # made on first use, inside the running loop
            tls = ssl.create_default_context(cafile=self.access.ca_file or None)
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=tls, limit=4),
                                                  trust_env=False, raise_for_status=False)
        return self._session

    def _headers(self) -> dict[str, str]:
        headers = {"Accept": "application/json"}
        if self.access.token_file:
            try:
                token = Path(self.access.token_file).read_text().strip()
            except OSError as exc:
                raise ApiError(f"token file {self.access.token_file}: {exc}") from None
            headers["Authorization"] = f"Bearer {token}"
        return headers

    async def get(self, path: str, params: Mapping[str, str] | None = None) -> dict[str, Any]:
        timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
        try:
            async with self._client().get(self.access.base_url + path, params=params, headers=self._headers(),
                                          timeout=timeout) as response:
                await _check(response, path)
                body = await response.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise ApiError(f"GET {path}: {type(exc).__name__}: {exc}") from None
        if not isinstance(body, dict):
            raise ApiError(f"GET {path}: not a JSON object")
        return body

    async def watch(self, path: str, params: Mapping[str, str]) -> AsyncIterator[WatchEvent]:
        """The collection's events from `params['resourceVersion']` on, until the server ends the
        watch (WATCH_TIMEOUT_S); Expired on 410, as a status or as an ERROR event."""
        query = {**params, "watch": "1", "allowWatchBookmarks": "true", "timeoutSeconds": str(WATCH_TIMEOUT_S)}
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=REQUEST_TIMEOUT_S,
                                        sock_read=WATCH_TIMEOUT_S + _WATCH_READ_MARGIN_S)
        try:
            async with self._client().get(self.access.base_url + path, params=query, headers=self._headers(),
                                          timeout=timeout, read_bufsize=_LINE_BUFFER) as response:
                await _check(response, path)
                async for line in response.content:  # one event a line
                    if not line.strip():
                        continue
                    event = WatchEvent.parse(line)
                    if event.expired:
                        raise Expired(f"watch {path}: {event.error()}")
                    if event.type == "ERROR":
                        raise ApiError(f"watch {path}: {event.error()}")
                    yield event
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:  # ValueError: a line over the buffer
            raise ApiError(f"watch {path}: {type(exc).__name__}: {exc}") from None

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


async def _check(response: aiohttp.ClientResponse, path: str) -> None:
    if response.status == 200:
        return
    text = (await response.text(errors="replace"))[:300]
    kind = Expired if response.status == GONE else NotFound if response.status == 404 else ApiError
    raise kind(f"{response.method} {path}: {response.status} {text}")


class Backoff:
    """Seconds to wait before the next attempt: exponential from `first_s` to `max_s`, full jitter."""

    def __init__(self, first_s: float = 0.5, max_s: float = 30.0, rng: random.Random | None = None):
        self.first_s, self.max_s = first_s, max_s
        self._rng = rng or random.Random()
        self._failures = 0

    def next(self) -> float:
        ceiling = min(self.max_s, self.first_s * 2 ** self._failures)
        self._failures += 1
        return self._rng.uniform(ceiling / 2, ceiling)

    def reset(self) -> None:
        self._failures = 0
