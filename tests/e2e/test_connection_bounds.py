"""The gateway's client connections are bounded before the app sees a request: a head that
does not arrive in time (408) or is too large (431) closes the connection, and connections
beyond the limit get 503. Raw sockets against a real gateway process."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from harness.launch import Gateway

pytestmark = pytest.mark.e2e

HEAD_TIMEOUT_S = 1.0
MAX_HEAD = 16 * 1024
MAX_CONNECTIONS = 40


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    toml = (f"[client_connections]\nheader_timeout_s = {HEAD_TIMEOUT_S}\nmax_header_bytes = {MAX_HEAD}\n"
            f"max_connections = {MAX_CONNECTIONS}\n")
    gw = Gateway(tmp_path_factory.mktemp("bounds"), [], extra_toml=toml)
    yield gw
    gw.stop()


def _connect(gateway: Gateway) -> socket.socket:
    return socket.create_connection(("127.0.0.1", gateway.port), timeout=10)


def _read_until_closed(sock: socket.socket, timeout: float) -> bytes:
    """Everything the server sends until it closes (raises socket.timeout if it never does)."""
    sock.settimeout(timeout)
    got = b""
    while chunk := sock.recv(65536):
        got += chunk
    return got


def test_half_open_connections_are_closed_after_the_header_timeout(gateway: Gateway) -> None:
    silent = [_connect(gateway) for _ in range(20)]
    partial = [_connect(gateway) for _ in range(10)]
    for sock in partial:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-slow: ")
    started = time.monotonic()
    try:
        answers = [_read_until_closed(sock, timeout=HEAD_TIMEOUT_S + 10) for sock in silent + partial]
    finally:
        for sock in silent + partial:
            sock.close()
    assert time.monotonic() - started < HEAD_TIMEOUT_S + 5
    assert all(answer.startswith(b"HTTP/1.1 408 ") for answer in answers), answers[:2]


def test_a_head_trickled_byte_by_byte_is_cut_off_at_the_header_timeout(gateway: Gateway) -> None:
    with _connect(gateway) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n")
        deadline = time.monotonic() + HEAD_TIMEOUT_S + 5
        with pytest.raises(OSError):  # the server closes: a send fails (EPIPE / ECONNRESET)
            while time.monotonic() < deadline:
                sock.sendall(b"x-a: b\r\n")
                time.sleep(0.05)
        assert time.monotonic() < deadline


def test_an_oversized_head_gets_431_and_the_connection_closes(gateway: Gateway) -> None:
    for head in (b"x-big: " + b"a" * (MAX_HEAD + 1) + b"\r\n",  # one huge line
                 b"".join(b"x-h%d: %s\r\n" % (i, b"b" * 100) for i in range(MAX_HEAD // 100 + 10))):  # many lines
        with _connect(gateway) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n" + head)  # the head never ends
            answer = _read_until_closed(sock, timeout=HEAD_TIMEOUT_S / 2)  # before the timeout: the size
        assert answer.startswith(b"HTTP/1.1 431 "), answer[:100]
        assert b"request_header_fields_too_large" in answer


def test_an_8_mib_header_is_never_taken_whole(gateway: Gateway) -> None:
    with _connect(gateway) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\nx-big: ")
        sent = 0
        with pytest.raises(OSError):
            while sent < 8 * 1024 * 1024:
                sock.sendall(b"a" * 65536)
                sent += 65536
        assert sent < 8 * 1024 * 1024


def test_heads_within_the_bounds_are_served_and_an_idle_keep_alive_connection_too(gateway: Gateway) -> None:
    with httpx.Client(base_url=gateway.url, timeout=10) as client:
        assert client.get("/health", headers={"x-large": "c" * (MAX_HEAD // 2)}).status_code == 200
        time.sleep(HEAD_TIMEOUT_S * 1.5)  # idle between requests: the keep-alive timeout's, not the head's
        assert client.get("/health").status_code == 200


def test_connections_beyond_the_limit_get_503(gateway: Gateway) -> None:
    held = [_connect(gateway) for _ in range(MAX_CONNECTIONS)]
    try:
        time.sleep(0.2)
        with _connect(gateway) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            assert _read_until_closed(sock, timeout=5).startswith(b"HTTP/1.1 503 ")
    finally:
        for sock in held:
            sock.close()
    time.sleep(0.2)
    assert httpx.get(gateway.url + "/health", timeout=10).status_code == 200
