"""The gateway's error hierarchy and its one translation into protocol error bodies.

    GatewayError                    -> rendered as OpenAI or Anthropic error JSON
      (status_code, message, type)
    NoHealthyWorker(GatewayError)   503 no worker can take the request
    Overloaded(GatewayError)        429 admission control; carries Retry-After
    UpstreamFailed(GatewayError)    502/503 every attempt failed before the first token
    Unauthorized / Forbidden        401 / 403 API key missing or unknown / model not allowed
    RateLimited(GatewayError)       429 per-key limits; carries Retry-After and x-ratelimit-*
    PayloadTooLarge(GatewayError)   413 body over `max_body_bytes`
    InternalError(GatewayError)     500 an unexpected exception (logged where it was caught)

OpenAI bodies: `{"error": {"message", "type", "param", "code"}}`; Anthropic bodies:
`{"type": "error", "error": {"type", "message"}}`. `client_protocol` says which one a caller
reads when no request has been parsed.

A request the bridge refuses (recipe_bridge BridgeError: 400, or 404 `model_not_found`) is
rendered the same way.

Upstream (aiohttp) failures are mapped to `UpstreamError` in gateway/worker_client.py,
the one place that knows the HTTP client.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson
from starlette.responses import Response

from deepinfer_gateway.recipe_bridge.prepare import ApiProtocol

_OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


class GatewayError(Exception):
    status_code = 500

    def __init__(
        self,
        message: str,
        *,
        status_code: int | None = None,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.message = message
        if status_code is not None:
            self.status_code = status_code
        self.param = param
        self.code = code
        self.headers = headers or {}


class NoHealthyWorker(GatewayError):
    status_code = 503


class Overloaded(GatewayError):
    status_code = 429


class UpstreamFailed(GatewayError):
    status_code = 502


class Unauthorized(GatewayError):
    status_code = 401


class Forbidden(GatewayError):
    status_code = 403


class RateLimited(GatewayError):
    status_code = 429


class PayloadTooLarge(GatewayError):
    status_code = 413


class InternalError(GatewayError):
    status_code = 500

    def __init__(self) -> None:
        super().__init__("The server had an error while processing your request.")


def client_protocol(path: str, headers: Mapping[str, str]) -> ApiProtocol | None:
    """The error format a caller reads: Anthropic's under /v1/messages or from an Anthropic
    SDK (it always sends `anthropic-version`), OpenAI's otherwise."""
    return ApiProtocol.MESSAGES if path.startswith("/v1/messages") or "anthropic-version" in headers else None


def error_payload(protocol: ApiProtocol | None, status: int, message: str, param: str | None = None,
                  code: str | None = None) -> dict[str, Any]:
    if protocol is ApiProtocol.MESSAGES:
        kind = _ANTHROPIC_TYPES.get(status, "api_error")
        return {"type": "error", "error": {"type": kind, "message": message}}
    kind = _OPENAI_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code or kind}}


def error_response(protocol: ApiProtocol | None, error: GatewayError) -> Response:
    body = error_payload(protocol, error.status_code, error.message, error.param, error.code)
    return Response(orjson.dumps(body), status_code=error.status_code, media_type="application/json",
                    headers=error.headers)


def stream_error_frame(protocol: ApiProtocol, message: str, status: int = 502) -> bytes:
    """A protocol-conformant error event for a stream that already started (never truncate silently)."""
    body = error_payload(protocol, status, message)
    if protocol is ApiProtocol.CHAT:
        return b"data: " + orjson.dumps(body) + b"\n\n"
    if protocol is ApiProtocol.RESPONSES:
        event = {"type": "error", "code": body["error"]["type"], "message": message, "param": None}
        return b"event: error\ndata: " + orjson.dumps(event) + b"\n\n"
    return b"event: error\ndata: " + orjson.dumps(body) + b"\n\n"
