"""The one place that knows the upstream HTTP library: aiohttp, chosen by measurement
(docs/architecture: ~0.2 ms CPU per short request versus ~0.8 ms for httpx).

`HttpPool` owns the pooled session and builds every request to a worker (`post`, `get`:
headers in one place); `http_errors` turns every aiohttp failure into an `UpstreamError`
(errors.py) with an `UpstreamKind` (metrics label) and a `retryable` verdict for the router;
`LineStream` reads an open response line by line under a per-read timeout. The engine
adapters (dgw.py, vllm.py, openai.py) use only these.

Every call to a worker goes through the pool's one session, whose default headers carry the
worker token (`Authorization: Bearer`, worker_auth.py; vLLM's `--api-key` reads the same
header): generate, abort, probes, KV event polls and the adapters all send it. A changed
token file reaches the header within TOKEN_REFRESH_S.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import aiohttp
import orjson

from deepinfer_gateway.core import protocol as wp
from deepinfer_gateway.core import tracing
from deepinfer_gateway.core.errors import UpstreamError, UpstreamKind
from deepinfer_gateway.core.worker_auth import SecretTokens, bearer
from deepinfer_gateway.gateway.upstream.base import UNCOUNTED, MuxMetrics, Timeouts
from deepinfer_gateway.kvcache.packed_ids import ids_json

TOKEN_REFRESH_S = 1.0

POOL_KEEP_ALIVE_S = 30  # below the workers' server keep-alive (asgi.KEEP_ALIVE_S)
MAX_LINE_BYTES = 64 << 20  # one worker message; bounds what a broken worker makes the gateway buffer

Response = aiohttp.ClientResponse


@contextmanager
def http_errors(what: str, *, broken: UpstreamKind = UpstreamKind.DISCONNECT) -> Iterator[None]:
    """Map the HTTP library's failures inside the block to `UpstreamError`s about `what` (a URL):
    a timeout, a refused connection, and `broken` for any other (an open connection that broke;
    a control call passes CONNECT: the worker is unreachable)."""
    try:
        yield
    except TimeoutError:
        raise UpstreamError(UpstreamKind.TIMEOUT, f"{what} timed out") from None
    except aiohttp.ClientConnectorError as exc:
        raise UpstreamError(UpstreamKind.CONNECT, f"cannot reach {what}: {exc}") from None
    except (aiohttp.ClientError, ConnectionError, OSError) as exc:  # e.g. a pooled connection closed
        raise UpstreamError(broken, f"connection to {what} broke: {exc}") from None


class HttpPool:
    """The gateway's pooled connections to its workers, and the requests made on them."""

    def __init__(self, timeouts: Timeouts = Timeouts(), session: aiohttp.ClientSession | None = None,
                 tokens: SecretTokens | None = None, mux: bool = True, mux_metrics: MuxMetrics = UNCOUNTED):
        self.timeouts = timeouts
        self.mux = mux  # worker protocol v2 where a worker speaks it (the `worker_protocol` setting)
        self.mux_metrics = mux_metrics
        self._tokens = tokens
        self._token_task: asyncio.Task[None] | None = None
        self._session = session
        self._owns_session = session is None
        self._control = aiohttp.ClientTimeout(total=timeouts.control_s)

    async def start(self) -> None:
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, enable_cleanup_closed=True,
                                             keepalive_timeout=POOL_KEEP_ALIVE_S)
            self._session = aiohttp.ClientSession(
                connector=connector, json_serialize=lambda o: orjson.dumps(o).decode(),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.timeouts.connect_s),
            )
        if self._tokens is not None:
            self._session.headers.update(bearer(self._tokens))
            self._token_task = asyncio.create_task(self._follow_token(self._tokens, self._session))

    @staticmethod
    async def _follow_token(tokens: SecretTokens, session: aiohttp.ClientSession) -> None:
        """Keep the session's Authorization header on the token file's first token."""
        while True:
            await asyncio.sleep(TOKEN_REFRESH_S)
            session.headers.update(bearer(tokens))

    async def close(self) -> None:
        if self._token_task is not None:
            self._token_task.cancel()
            self._token_task = None
        if self._session is not None and self._owns_session:
            await self._session.close()
        self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "HttpPool.start() was not called"
        return self._session

    def headers(self, request_id: str | None = None) -> dict[str, str]:
        """Every request's headers (a traced call's context, its request id)."""
        headers = {"content-type": "application/json"}
        if request_id is not None:
            headers[wp.REQUEST_ID_HEADER] = request_id
            tracing.inject(headers)
        return headers

    async def post(self, url: str, path: str, body: Any, request_id: str, *,
                   control: bool = False) -> Response:
        """POST `body` (JSON) to `url + path`; the response as it starts (any status). `control`:
        a short call under the control timeout (abort)."""
        with http_errors(url):
            if control:
                return await self.session.post(url + path, data=ids_json(body), headers=self.headers(request_id),
                                               timeout=self._control)
            return await self.session.post(url + path, data=ids_json(body), headers=self.headers(request_id))

    async def get(self, url: str, path: str) -> tuple[int, bytes]:
        """A control GET: (status, body) under the control timeout; failures as UpstreamErrors."""
        with http_errors(f"{url}{path}", broken=UpstreamKind.CONNECT):
            async with self.session.get(url + path, headers=self.headers(), timeout=self._control) as r:
                return r.status, await r.read()

    async def get_json(self, url: str, path: str) -> Any:
        status, raw = await self.get(url, path)
        if status != 200:
            raise UpstreamError(UpstreamKind.HTTP_STATUS, f"{url}{path} answered {status}", status=status)
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            raise UpstreamError(UpstreamKind.PROTOCOL, f"{url}{path} returned malformed JSON") from None


async def read_body(response: Response, what: str, timeout_s: float) -> bytes:
    """A response's whole body within `timeout_s`; the connection is dropped (the worker aborts)
    if the wait is cut short, the client going away included."""
    try:
        with http_errors(what):
            async with asyncio.timeout(timeout_s):
                return await response.read()
    except BaseException:
        response.close()
        raise


class _EventTimeout(Exception):
    """Raised into a blocked read by a LineStream's watchdog."""


class LineStream:
    """An open HTTP response read line by line under a per-read timeout (the first read
    waits `first_s`, later ones `between_s`). `close()` drops the connection, which the
    worker (and vLLM) treat as an abort.

    Lines are cut here from what the connection has buffered (`readany`), not by aiohttp's
    `readline`: a worker message is usually exactly one read, and lines that arrived
    together are handed out without awaiting again (~20% less gateway CPU per relayed
    event than readline's scan, measured with bench/gateway_capacity.py --profile)."""

    def __init__(self, response: Response, first_s: float, between_s: float):
        self._response = response
        self._first_s = first_s
        self._between_s = between_s
        self._first = True
        self._buffer = b""  # read but not yet returned: the start of the next line(s)
        self._timeout = 0.0  # of the read in progress
        self._deadline = 0.0
        self._reading = False
        self._watchdog: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def read_line(self) -> bytes:
        """The next line with its b"\n" (at the end of the stream: what is left, then b"")."""
        buffer = self._buffer
        end = buffer.find(b"\n")
        if end < 0:
            # Inline rather than a helper coroutine: every relayed event resumes this chain.
            timeout = self._first_s if self._first else self._between_s
            self._first = False
            # One watchdog timer per stream, re-armed only when it fires, instead of a timeout
            # object per read: asyncio.timeout costs ~8% of the gateway's CPU per relayed token
            # (enter, reschedule, exit: timer heap pushes and cancels), wait_for even more (a Task).
            loop = self._loop
            if loop is None:  # looked up once: get_running_loop costs a getpid() system call
                loop = self._loop = asyncio.get_running_loop()
            self._timeout = timeout
            self._deadline = loop.time() + timeout
            if self._watchdog is None:
                self._watchdog = loop.call_at(self._deadline, self._check, loop)
            self._reading = True
            content = self._response.content
            try:
                while True:
                    chunk = await content.readany()
                    if not chunk:  # the stream ended
                        self._disarm()
                        self._buffer = b""
                        return buffer
                    buffer = buffer + chunk if buffer else chunk
                    if b"\n" in chunk:
                        break
                    if len(buffer) > MAX_LINE_BYTES:
                        raise UpstreamError(UpstreamKind.PROTOCOL, f"worker sent a line over {MAX_LINE_BYTES} bytes")
            except _EventTimeout:
                raise UpstreamError(UpstreamKind.TIMEOUT, f"no event from worker within {timeout}s") from None
            except (aiohttp.ClientError, ConnectionError) as exc:
                raise UpstreamError(UpstreamKind.DISCONNECT, f"worker connection lost: {exc}") from None
            finally:
                self._reading = False
            end = buffer.find(b"\n")
        if end == len(buffer) - 1:
            self._buffer = b""
            return buffer
        self._buffer = buffer[end + 1:]
        return buffer[:end + 1]

    def buffered(self) -> bool:
        """A whole line is received (or the read would fail at once): `read_line` will not wait.
        Takes what the connection holds without waiting (aiohttp's `read_nowait`)."""
        if b"\n" in self._buffer:
            return True
        try:
            chunk = self._response.content.read_nowait()
        except Exception:  # the stream's error (a lost connection...): the next read raises it at once
            return True
        if not chunk:
            return False
        self._buffer = self._buffer + chunk if self._buffer else chunk
        return b"\n" in chunk

    def _check(self, loop: asyncio.AbstractEventLoop) -> None:
        """The watchdog fired: time out the read in progress if it has waited its whole timeout."""
        self._watchdog = None
        if not self._reading:
            return  # nobody waits; the next read re-arms
        if loop.time() < self._deadline:  # events came in meanwhile: wait for the current read's deadline
            self._watchdog = loop.call_at(self._deadline, self._check, loop)
            return
        # Wakes the blocked read with this exception (as a cancelled wait would be).
        self._response.content.set_exception(_EventTimeout(f"no event within {self._timeout}s"))

    def _disarm(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None

    def close(self) -> None:
        self._disarm()
        self._response.close()

    def release(self) -> None:
        """The reply was read to its end: the connection goes back to the pool."""
        self._disarm()
        self._response.release()
