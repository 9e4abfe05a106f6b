"""Worker protocol v1 client: the one place that knows the upstream HTTP library.

aiohttp, chosen by measurement (docs/architecture: ~0.2 ms CPU per short request
versus ~0.8 ms for httpx). Every aiohttp failure becomes an `UpstreamError` (errors.py) with
an `UpstreamKind` (metrics label) and a `retryable` verdict for the router.

Workers of another engine (`WorkerSpec.engine`, e.g. vLLM) are registered by URL; their
`generate` goes through their adapter (vllm_upstream.py), which yields the same events.

Every call to a worker goes through one session, whose default headers carry the worker
token (`Authorization: Bearer`, worker_auth.py; vLLM's `--api-key` reads the same header):
generate, abort, probes, KV event polls and the adapters all send it. A changed token file
reaches the header within TOKEN_REFRESH_S.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import aiohttp
import orjson

from deepinfer_gateway import protocol as wp
from deepinfer_gateway import tracing
from deepinfer_gateway.config import WorkerEngine, WorkerSpec
from deepinfer_gateway.errors import UpstreamError, UpstreamKind
from deepinfer_gateway.worker_auth import SecretTokens, bearer

if TYPE_CHECKING:
    from deepinfer_gateway.gateway.openai_upstream import OpenAIFacts, OpenAIUpstream
    from deepinfer_gateway.gateway.vllm_upstream import VllmFacts, VllmUpstream
    from deepinfer_gateway.recipe_bridge.tokenizer import TokenizerBundle


TOKEN_REFRESH_S = 1.0
POOL_KEEP_ALIVE_S = 30  # below the workers' server keep-alive (asgi.KEEP_ALIVE_S)
MAX_LINE_BYTES = 64 << 20  # one worker message; bounds what a broken worker makes the gateway buffer


@dataclass(frozen=True)
class Timeouts:
    connect_s: float = 2.0
    first_event_s: float = 30.0  # ready event: queue wait is the engine's business, but not forever
    between_events_s: float = 120.0  # a long prefill may sit between ready and the first token
    control_s: float = 2.0  # abort, health, load, kv events


class EventStream(Protocol):
    """An open generate call as the request path reads it: worker-protocol events, then None."""

    async def next_event(self) -> dict[str, Any] | None: ...

    def close(self) -> None: ...


class _EventTimeout(Exception):
    """Raised into a blocked read by a WorkerStream's watchdog."""


class LineStream:
    """An open HTTP response read line by line under a per-read timeout (the first read
    waits `first_s`, later ones `between_s`). `close()` drops the connection, which the
    worker (and vLLM) treat as an abort.

    Lines are cut here from what the connection has buffered (`readany`), not by aiohttp's
    `readline`: a worker message is usually exactly one read, and lines that arrived
    together are handed out without awaiting again (~20% less gateway CPU per relayed
    event than readline's scan, measured with bench/gateway_capacity.py --profile)."""

    def __init__(self, response: aiohttp.ClientResponse, first_s: float, between_s: float):
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

    def _check(self, loop: asyncio.AbstractEventLoop) -> None:
        """The watchdog fired: time out the read in progress if it has waited its whole timeout."""
        self._watchdog = None
        if not self._reading:
            return  # nobody waits; the next read re-arms
        if loop.time() < self._deadline:  # events came in meanwhile: wait for the current read's deadline
            self._watchdog = loop.call_at(self._deadline, self._check, loop)
            return
        # Wakes the blocked readline with this exception (as a cancelled wait would be).
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


class WorkerStream(LineStream):
    """An open generate call; iterate events (dicts)."""

    def __init__(self, response: aiohttp.ClientResponse, timeouts: Timeouts):
        super().__init__(response, timeouts.first_event_s, timeouts.between_events_s)

    async def next_event(self) -> dict[str, Any] | None:
        line = await self.read_line()
        if not line:
            return None
        try:
            event = orjson.loads(line)
        except orjson.JSONDecodeError:
            raise UpstreamError(UpstreamKind.PROTOCOL, f"worker sent a malformed line: {line[:80]!r}") from None
        if not isinstance(event, dict) or "event" not in event:
            raise UpstreamError(UpstreamKind.PROTOCOL, f"worker sent an unknown message: {line[:80]!r}")
        return event


class WorkerClient:
    def __init__(self, timeouts: Timeouts = Timeouts(), session: aiohttp.ClientSession | None = None,
                 tokenizer: TokenizerBundle | None = None, tokens: SecretTokens | None = None):
        self.timeouts = timeouts
        self._tokens = tokens
        self._token_task: asyncio.Task[None] | None = None
        self._session = session
        self._owns_session = session is None
        self._tokenizer = tokenizer  # openai workers re-tokenize their text with it
        self._vllm: dict[str, VllmUpstream | OpenAIUpstream] = {}  # by URL: OpenAI servers (vllm, openai engines)

    def register(self, spec: WorkerSpec) -> None:
        """Route calls to `spec.url` through its engine's adapter (worker protocol: nothing to do)."""
        from deepinfer_gateway.gateway.openai_upstream import OpenAIUpstream  # here: they import this module
        from deepinfer_gateway.gateway.vllm_upstream import VllmUpstream

        if spec.engine is WorkerEngine.VLLM:
            self._vllm[spec.url] = VllmUpstream(spec)
        elif spec.engine is WorkerEngine.OPENAI:
            assert self._tokenizer is not None, "openai workers need the WorkerClient's tokenizer"
            self._vllm[spec.url] = OpenAIUpstream(spec, self._tokenizer)
        else:
            self._vllm.pop(spec.url, None)

    def unregister(self, url: str) -> None:
        self._vllm.pop(url, None)

    async def vllm_kv_salt(self, spec: WorkerSpec) -> bytes:
        """The salt of a vLLM worker's block hashes, as the router computes it from its info."""
        from deepinfer_gateway.gateway.vllm_upstream import probe  # here: it imports this module
        from deepinfer_gateway.kvcache.hashing import kv_salt

        info = (await probe(self.session, spec, self.timeouts.control_s)).info(spec)
        return kv_salt(info.model, info.kv_format)

    async def probe_vllm(self, url: str) -> VllmFacts | OpenAIFacts:
        """A registered vLLM (or openai) worker's model, context, block size and load."""
        return await self._vllm[url].probe(self.session, self.timeouts.control_s)

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
        assert self._session is not None, "WorkerClient.start() was not called"
        return self._session

    async def generate(self, url: str, body: dict[str, Any], request_id: str) -> EventStream:
        vllm = self._vllm.get(url)
        if vllm is not None:
            return await vllm.generate(self.session, body, request_id, self.timeouts)
        try:
            response = await self.session.post(
                url + wp.GENERATE_PATH, data=orjson.dumps(body),
                headers=tracing.inject({"content-type": "application/json", wp.REQUEST_ID_HEADER: request_id}),
            )
        except TimeoutError:
            raise UpstreamError(UpstreamKind.TIMEOUT, f"connect to {url} timed out") from None
        except aiohttp.ClientConnectorError as exc:
            raise UpstreamError(UpstreamKind.CONNECT, f"cannot reach {url}: {exc}") from None
        except (aiohttp.ClientError, ConnectionError, OSError) as exc:  # e.g. a pooled connection closed
            raise UpstreamError(UpstreamKind.DISCONNECT, f"connection to {url} broke: {exc}") from None
        if response.status != 200:
            text = (await response.read())[:300].decode(errors="replace")
            response.release()
            retryable = response.status >= 500 or response.status == 429
            raise UpstreamError(UpstreamKind.HTTP_STATUS, f"worker {url} answered {response.status}: {text}",
                                retryable=retryable, status=response.status, detail=text)
        return WorkerStream(response, self.timeouts)

    async def abort(self, url: str, request_id: str) -> None:
        """Best effort: the dropped connection already aborts; this covers proxies that keep it open.
        vLLM has no abort endpoint: the dropped connection is its abort."""
        if url in self._vllm:
            return
        try:
            async with self.session.post(url + wp.ABORT_PATH, data=orjson.dumps({"request_id": request_id}),
                                         headers={"content-type": "application/json"},
                                         timeout=aiohttp.ClientTimeout(total=self.timeouts.control_s)) as r:
                await r.read()
        except (aiohttp.ClientError, TimeoutError, OSError):
            pass

    async def get_json(self, url: str, path: str) -> Any:
        try:
            async with self.session.get(url + path,
                                        timeout=aiohttp.ClientTimeout(total=self.timeouts.control_s)) as r:
                if r.status != 200:
                    raise UpstreamError(UpstreamKind.HTTP_STATUS, f"{url}{path} answered {r.status}", status=r.status)
                return orjson.loads(await r.read())
        except TimeoutError:
            raise UpstreamError(UpstreamKind.TIMEOUT, f"{url}{path} timed out") from None
        except (aiohttp.ClientError, OSError) as exc:
            raise UpstreamError(UpstreamKind.CONNECT, f"{url}{path}: {exc}") from None
        except orjson.JSONDecodeError:
            raise UpstreamError(UpstreamKind.PROTOCOL, f"{url}{path} returned malformed JSON") from None
