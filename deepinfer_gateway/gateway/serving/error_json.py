"""The one translation of errors into protocol bodies: OpenAI or Anthropic error JSON.

The error tree is deepinfer_gateway/core/errors.py. The app's handlers render a GatewayError
with `error_response`; a stream that already started ends with `stream_error_frame`.

OpenAI bodies: `{"error": {"message", "type", "param", "code"}}`; Anthropic bodies:
`{"type": "error", "error": {"type", "message"}}`. `client_protocol` says which one a caller
reads when no request has been parsed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson
from starlette.responses import Response

from deepinfer_gateway.core.errors import GatewayError
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
    405: "invalid_request_error",
    413: "request_too_large",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


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
