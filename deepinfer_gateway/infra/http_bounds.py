"""Bounds on a client connection that the ASGI app cannot set: its request heads' time and
size, and how long it may leave the responses unread.

uvicorn arms no timer on a new connection (only between requests), and its httptools parser
takes headers of any size, so a client could hold a connection open forever without sending
a request, or send megabytes of headers. `bounded_http_protocol` returns uvicorn's httptools
protocol with two bounds on each request head (request line and headers):

- time: the head must arrive whole within `header_timeout_s` of the connection opening (the
  first request) or of the request's first byte (later ones; between requests uvicorn's
  keep-alive timeout applies); else 408 and the connection closes.
- size: beyond `max_header_bytes`, 431 and the connection closes. Completed header lines are
  counted as the parser hands them over; a line still arriving (httptools buffers it whole)
  by the bytes read while the head is open (for a later request on a connection, from its
  second read on: its first may end the request before), so past the bound by one read at most.

A client that stops reading leaves the response's writes waiting forever (the app's `send`
waits for the socket to drain), and with them the request it holds on a worker. When the
connection's write buffer is over its high-water mark (the transport paused writing) for
`write_timeout_s` without draining, the connection is aborted: the app sees the client gone
(http.disconnect) and ends the request as for any client that left. The abort resets the
connection (SO_LINGER 0): a plain close would leave the kernel holding the unsent bytes, probing
the client's closed window with backed-off timers for minutes before the end reaches it.

The number of connections is bounded by uvicorn's own `limit_concurrency` (503 beyond it).
"""

from __future__ import annotations

import asyncio
import socket
import struct
from dataclasses import dataclass
from typing import Any, ClassVar

import orjson
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol


@dataclass(frozen=True)
class ConnectionBounds:
    header_timeout_s: float
    max_header_bytes: int
    max_connections: int
    write_timeout_s: float


_RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends RST and drops what is unsent


class _HeadTooLarge(Exception):
    """Raised from a parser callback to stop parsing an oversized head."""


def _error_body(message: str, code: str) -> bytes:
    # OpenAI's error shape: the protocol of the request is unknown before its head is read.
    return orjson.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                   "code": code}})


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    bounds: ClassVar[ConnectionBounds]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None
        self._write_timer: asyncio.TimerHandle | None = None
        self._head_lines = 0  # bytes of the head's completed request line and header lines
        self._head_reads = 0  # bytes read while the head was open (a later request's: past its first read)
        self._refusing = False

    # Connection events

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        self._cancel_write_timer()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_timer is None:
            self._write_timer = self.loop.call_later(self.bounds.write_timeout_s, self._write_timed_out)

    def resume_writing(self) -> None:
        self._cancel_write_timer()
        super().resume_writing()

    def _write_timed_out(self) -> None:
        self._write_timer = None
        who = f"{self.client[0]}:{self.client[1]}" if self.client else "a client"
        self.logger.info("%s took no response bytes for %g s: connection aborted", who, self.bounds.write_timeout_s)
        sock = self.transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET)
        self.transport.abort()

    def _cancel_write_timer(self) -> None:
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def data_received(self, data: bytes) -> None:
        # A read that began a later request may end the one before too: only reads while the head
        # was already open (or the connection's first) are counted whole.
        head_was_open = self._head_timer is not None
        super().data_received(data)
        if self._head_timer is None or self.transport.is_closing():
            return
        if head_was_open:
            self._head_reads += len(data)
        if self._head_reads > self.bounds.max_header_bytes:
            self._refuse_head_too_large()

    # Parser callbacks

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_lines = self._head_reads = 0
        if self._head_timer is None:
            self._arm_head_timer()

    def on_url(self, url: bytes) -> None:
        self._count_head(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_head(len(name) + len(value) + 4)
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._cancel_head_timer()
        super().on_headers_complete()

    # Refusals

    def send_400_response(self, msg: str) -> None:
        if self._refusing:  # a callback stopped the parser for an oversized head
            self._refuse_head_too_large()
        else:
            super().send_400_response(msg)

    def _count_head(self, size: int) -> None:
        self._head_lines += size
        if self._head_lines > self.bounds.max_header_bytes:
            self._refusing = True
            raise _HeadTooLarge

    def _refuse_head_too_large(self) -> None:
        limit = self.bounds.max_header_bytes
        self._answer_and_close(431, _error_body(f"Request line and headers exceed {limit} bytes.",
                                                "request_header_fields_too_large"))

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            self._arm_head_timer()  # a pipelined head waits behind a response in progress
            return
        timeout = self.bounds.header_timeout_s
        self._answer_and_close(408, _error_body(f"Request headers not received within {timeout:g} s.",
                                                "request_timeout"))

    def _answer_and_close(self, status: int, body: bytes) -> None:
        self._cancel_head_timer()
        if self.transport.is_closing():
            return
        head = [STATUS_LINE[status]]
        for name, value in self.server_state.default_headers:
            head += [name, b": ", value, b"\r\n"]
        head += [b"content-type: application/json\r\ncontent-length: ", str(len(body)).encode(),
                 b"\r\nconnection: close\r\n\r\n", body]
        self.transport.write(b"".join(head))
        self.transport.close()

    def _arm_head_timer(self) -> None:
        self._cancel_head_timer()
        self._head_timer = self.loop.call_later(self.bounds.header_timeout_s, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None


def bounded_http_protocol(bounds: ConnectionBounds) -> type[BoundedHttpToolsProtocol]:
    """The protocol class uvicorn instantiates per connection, carrying `bounds`."""
    return type("BoundedHttpToolsProtocol", (BoundedHttpToolsProtocol,), {"bounds": bounds})
