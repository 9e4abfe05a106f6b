"""Every failure the gateway names, in one tree. A leaf: imports no other module of the package.

    DeepInferError
    ├── GatewayError                 answered to the client as protocol error JSON
    │   │                            (status_code, message, param, code, headers)
    │   ├── BridgeError              400/404/413 a request the bridge refuses (recipe_bridge/prepare.py);
    │   │                            carries the served model once the name resolved (metrics label)
    │   ├── Unauthorized             401 API key missing or unknown
    │   ├── Forbidden                403 the key may not use this model or endpoint
    │   ├── PayloadTooLarge          413 body over `max_body_bytes`
    │   ├── RateLimited              429 per-key limits; carries Retry-After and x-ratelimit-*
    │   ├── Overloaded               429 admission control; carries Retry-After
    │   ├── ClientGone               499 the client left before its response started
    │   ├── InternalError            500 an unexpected exception (logged where it was caught)
    │   ├── UpstreamFailed           502 every attempt failed before the first token, or mid-answer
    │   ├── NoHealthyWorker          503 no worker can take the request
    │   └── WorkerRefused            the worker's own verdict on the request (its status: 400, 503 ...)
    └── UpstreamError                a failed worker call (gateway/upstream/http.py maps every aiohttp
                                     failure to one); `kind` is an UpstreamKind. Never shown as is:
                                     the request path retries it or raises one of the GatewayErrors

Translation to protocol JSON happens in one place, gateway/serving/error_json.py (the app's error
handler and the stream error frame).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Protocol

import orjson


class UpstreamKind(StrEnum):
    """Why a worker call failed; the `kind` label of dgw_upstream_errors_total and dgw_retries_total."""

    CONNECT = "connect"  # refused: the worker is down (ejected at once)
    DISCONNECT = "disconnect"  # an open connection broke
    TIMEOUT = "timeout"
    HTTP_STATUS = "http_status"  # the worker answered something other than 200
    PROTOCOL = "protocol"  # a malformed or unexpected message
    WORKER_ERROR = "worker_error"  # the worker finished the request with an error
    ENGINE = "engine"  # a stream that failed mid-way for a reason the gateway raised itself


# Kinds that count as a failed health check of the worker (passive health checking).
HEALTH_FAILURES = frozenset({UpstreamKind.CONNECT, UpstreamKind.DISCONNECT, UpstreamKind.TIMEOUT,
                             UpstreamKind.HTTP_STATUS, UpstreamKind.PROTOCOL})


class DeepInferError(Exception):
    """The root: any failure the gateway itself names."""


class GatewayError(DeepInferError):
    status_code = 500

    def __init__(self, message: str, *, status_code: int | None = None, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message = message
        if status_code is not None:
            self.status_code = status_code
        self.param = param
        self.code = code
        self.headers = headers or {}


class _ConversionError(Protocol):
    """deepseek-recipe's ConversionError, as far as BridgeError reads it."""

    # Read-only members: a read-only protocol member accepts a narrower type (`body: str`).
    @property
    def status_code(self) -> int: ...

    @property
    def body(self) -> str | bytes: ...


class BridgeError(GatewayError):
    def __init__(self, status_code: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message, status_code=status_code, param=param,
                         code=code or ("invalid_request_error" if status_code < 500 else "internal_error"))
        self.model: str | None = None  # the served model, once the requested name resolved (metrics label)

    @classmethod
    def model_not_found(cls, model: str) -> BridgeError:
        return cls(404, f"The model `{model}` does not exist or you do not have access to it.", param="model",
                   code="model_not_found")

    @classmethod
    def from_conversion(cls, error: _ConversionError) -> BridgeError:
        try:
            detail = orjson.loads(error.body)["error"]
            return cls(error.status_code, detail.get("message", str(error)), param=detail.get("param"))
        except (orjson.JSONDecodeError, KeyError, TypeError):
            return cls(error.status_code, str(error))


class Unauthorized(GatewayError):
    status_code = 401


class Forbidden(GatewayError):
    status_code = 403


class PayloadTooLarge(GatewayError):
    status_code = 413


class RateLimited(GatewayError):
    status_code = 429


class Overloaded(GatewayError):
    status_code = 429


class ClientGone(GatewayError):
    status_code = 499

    def __init__(self) -> None:
        super().__init__("client disconnected")


class InternalError(GatewayError):
    status_code = 500

    def __init__(self) -> None:
        super().__init__("The server had an error while processing your request.")


class UpstreamFailed(GatewayError):
    status_code = 502


class NoHealthyWorker(GatewayError):
    status_code = 503


class WorkerRefused(GatewayError):
    """A worker's non-retryable verdict (an invalid request, a 4xx answer), passed on with its status."""

    @classmethod
    def of(cls, exc: UpstreamError) -> WorkerRefused:
        return cls(exc.detail, status_code=exc.status or 400)


class UpstreamError(DeepInferError):
    """`detail`: the part a client may read (the worker's own message, else a sentence for the
    kind: never a worker's address), `str(exc)` the whole story for logs; `retryable`: the
    router's verdict; `status`: the worker's, when it gave one."""

    def __init__(self, kind: UpstreamKind, message: str, *, retryable: bool = True, status: int | None = None,
                 detail: str | None = None):
        super().__init__(message)
        self.kind = kind
        self.retryable = retryable
        self.status = status
        self.detail = _CLIENT_DETAIL[kind] if detail is None else detail


_CLIENT_DETAIL = {
    UpstreamKind.CONNECT: "the worker could not be reached",
    UpstreamKind.DISCONNECT: "the connection to the worker broke",
    UpstreamKind.TIMEOUT: "the worker did not answer in time",
    UpstreamKind.HTTP_STATUS: "the worker answered with an error status",
    UpstreamKind.PROTOCOL: "the worker sent an unexpected answer",
    UpstreamKind.WORKER_ERROR: "the worker reported an error",
    UpstreamKind.ENGINE: "the engine failed",
}
