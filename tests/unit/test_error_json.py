"""The error tree rendered at its one seam: statuses, OpenAI/Anthropic shapes, stream frames."""

from __future__ import annotations

import orjson
import pytest

from deepinfer_gateway.core import errors
from deepinfer_gateway.gateway.serving.error_json import client_protocol, error_response, stream_error_frame
from deepinfer_gateway.recipe_bridge.prepare import ApiProtocol

CASES = [  # (error, status, OpenAI type, Anthropic type)
    (errors.BridgeError(400, "bad", param="messages"), 400, "invalid_request_error", "invalid_request_error"),
    (errors.BridgeError.model_not_found("nope"), 404, "invalid_request_error", "not_found_error"),
    (errors.Unauthorized("key"), 401, "authentication_error", "authentication_error"),
    (errors.Forbidden("no"), 403, "permission_error", "permission_error"),
    (errors.PayloadTooLarge("big"), 413, "invalid_request_error", "request_too_large"),
    (errors.RateLimited("slow", headers={"retry-after": "3"}), 429, "rate_limit_error", "rate_limit_error"),
    (errors.Overloaded("busy"), 429, "rate_limit_error", "rate_limit_error"),
    (errors.ClientGone(), 499, "invalid_request_error", "api_error"),
    (errors.InternalError(), 500, "server_error", "api_error"),
    (errors.UpstreamFailed("all failed"), 502, "server_error", "api_error"),
    (errors.NoHealthyWorker("none"), 503, "server_error", "overloaded_error"),
]


@pytest.mark.parametrize(("error", "status", "openai_type", "anthropic_type"), CASES)
def test_each_error_renders_in_both_protocols(error: errors.GatewayError, status: int, openai_type: str,
                                              anthropic_type: str) -> None:
    assert isinstance(error, errors.DeepInferError)
    response = error_response(None, error)
    assert response.status_code == status and response.media_type == "application/json"
    body = orjson.loads(response.body)
    assert body == {"error": {"message": error.message, "type": openai_type, "param": error.param,
                              "code": error.code or openai_type}}
    anthropic = orjson.loads(error_response(ApiProtocol.MESSAGES, error).body)
    assert anthropic == {"type": "error", "error": {"type": anthropic_type, "message": error.message}}
    for name, value in error.headers.items():
        assert response.headers[name] == value


def test_bridge_error_codes() -> None:
    assert errors.BridgeError(400, "x").code == "invalid_request_error"
    assert errors.BridgeError(500, "x").code == "internal_error"
    assert errors.BridgeError.model_not_found("m").code == "model_not_found"


def test_worker_refusal_passes_on_the_workers_message_and_status() -> None:
    upstream = errors.UpstreamError(errors.UpstreamKind.WORKER_ERROR, "prompt_too_long: 9000 > 8192",
                                    retryable=False, status=400, detail="9000 > 8192")
    refused = errors.WorkerRefused.of(upstream)
    assert (refused.status_code, refused.message) == (400, "9000 > 8192")
    assert str(upstream) == "prompt_too_long: 9000 > 8192"
    no_status = errors.UpstreamError(errors.UpstreamKind.HTTP_STATUS, "answered", retryable=False)
    assert errors.WorkerRefused.of(no_status).status_code == 400


def test_upstream_kinds_are_the_metric_label_values() -> None:
    assert [str(k) for k in errors.UpstreamKind] == [
        "connect", "disconnect", "timeout", "http_status", "protocol", "worker_error", "engine"]


def test_stream_error_frames() -> None:
    chat = stream_error_frame(ApiProtocol.CHAT, "boom")
    assert chat.startswith(b"data: ") and orjson.loads(chat[6:])["error"]["type"] == "server_error"
    responses = stream_error_frame(ApiProtocol.RESPONSES, "boom")
    assert responses.startswith(b"event: error\ndata: ")
    assert orjson.loads(responses.split(b"data: ", 1)[1]) == {"type": "error", "code": "server_error",
                                                               "message": "boom", "param": None}
    messages = stream_error_frame(ApiProtocol.MESSAGES, "boom")
    assert orjson.loads(messages.split(b"data: ", 1)[1])["error"]["type"] == "api_error"


def test_client_protocol() -> None:
    assert client_protocol("/v1/messages", {}) is ApiProtocol.MESSAGES
    assert client_protocol("/v1/models", {"anthropic-version": "2023-06-01"}) is ApiProtocol.MESSAGES
    assert client_protocol("/v1/chat/completions", {}) is None


def test_the_tree_is_a_leaf() -> None:
    """errors.py imports no other module of the package (anything may import it)."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(errors))
    imported = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert not [m for m in imported if m and m.startswith("deepinfer_gateway")]
