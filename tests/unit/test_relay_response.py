"""RelayResponse as an ASGI app: Starlette StreamingResponse's headers and disconnect
handling (spec 2.3: an `http.disconnect` from receive; 2.4: send raising OSError), with
its `on_close` run however the response ends."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from starlette.requests import ClientDisconnect
from starlette.responses import StreamingResponse

from deepinfer_gateway.gateway.serving.relay import RelayResponse

SPEC_23 = {"type": "http", "asgi": {"spec_version": "2.3"}, "method": "POST", "path": "/"}
SPEC_24 = {"type": "http", "asgi": {"spec_version": "2.4"}, "method": "POST", "path": "/"}
HEADERS = {"cache-control": "no-cache", "x-request-id": "r1"}


class Client:
    """The server side of one request: what was sent, and a disconnect to trigger."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []
        self.gone = asyncio.Event()

    async def receive(self) -> dict[str, Any]:
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)

    def bodies(self) -> list[bytes]:
        return [m["body"] for m in self.sent if m["type"] == "http.response.body"]


def relay_response(chunks: list[bytes], closed: list[str], *, then: asyncio.Event | None = None,
                   log: list[str] | None = None) -> RelayResponse:
    async def body(send: Any) -> None:
        try:
            for chunk in chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            if then is not None:
                await then.wait()
        except asyncio.CancelledError:
            if log is not None:
                log.append("cancelled")
            raise

    return RelayResponse(body, lambda: closed.append("closed"), media_type="text/event-stream", headers=HEADERS)


def test_headers_are_streaming_responses() -> None:
    async def nothing() -> Any:
        yield b""

    expected = StreamingResponse(nothing(), media_type="text/event-stream", headers=HEADERS).raw_headers
    assert relay_response([], []).raw_headers == expected


async def test_a_complete_response_leaves_no_cancellation_behind() -> None:
    client, closed = Client(), list[str]()
    await relay_response([b"a", b"b"], closed)(SPEC_23, client.receive, client.send)
    assert client.sent[0]["type"] == "http.response.start" and client.sent[0]["status"] == 200
    assert client.bodies() == [b"a", b"b", b""] and client.sent[-1]["more_body"] is False
    client.gone.set()  # the watcher would see this now: it must be gone
    await asyncio.sleep(0.01)
    assert closed == ["closed"]
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0


async def test_a_client_leaving_cancels_the_body_and_ends_quietly() -> None:
    client, closed, log = Client(), list[str](), list[str]()
    never = asyncio.Event()
    serving = asyncio.ensure_future(relay_response([b"a"], closed, then=never, log=log)(
        SPEC_23, client.receive, client.send))
    await asyncio.sleep(0.01)
    assert client.bodies() == [b"a"] and not serving.done()
    client.gone.set()
    await asyncio.wait_for(serving, 1)
    assert serving.exception() is None  # the disconnect ends it as a normal return
    assert log == ["cancelled"] and closed == ["closed"]
    assert client.bodies() == [b"a"]  # no final chunk to a client that is gone


async def test_a_cancellation_from_outside_goes_on() -> None:
    client, closed = Client(), list[str]()
    serving = asyncio.ensure_future(relay_response([b"a"], closed, then=asyncio.Event())(
        SPEC_23, client.receive, client.send))
    await asyncio.sleep(0.01)
    serving.cancel()
    with pytest.raises(asyncio.CancelledError):
        await serving
    assert closed == ["closed"]


async def test_spec_24_a_failing_send_is_client_disconnect() -> None:
    closed: list[str] = []

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body":
            raise OSError("gone")

    async def receive() -> dict[str, Any]:
        raise AssertionError("2.4: no disconnect watcher")

    with pytest.raises(ClientDisconnect):
        await relay_response([b"a"], closed)(SPEC_24, receive, send)
    assert closed == ["closed"]


async def test_a_failing_body_still_closes() -> None:
    closed: list[str] = []

    async def body(send: Any) -> None:
        raise RuntimeError("bug")

    client = Client()
    with pytest.raises(RuntimeError, match="bug"):
        await RelayResponse(body, lambda: closed.append("closed"))(SPEC_23, client.receive, client.send)
    assert closed == ["closed"]
