"""A method a route does not serve: 405 with `Allow` (RFC 9110), in the caller's protocol's error shape."""

from __future__ import annotations

import httpx
import pytest

from harness.launch import Gateway


@pytest.mark.parametrize(("method", "path", "allow", "anthropic"), [
    ("GET", "/v1/chat/completions", "POST", False),
    ("PUT", "/v1/responses", "POST", False),
    ("GET", "/v1/messages", "POST", True),
    ("DELETE", "/v1/models", "GET", False),
    ("POST", "/v1/responses/resp_1/input_items", "GET", False),
    ("PUT", "/v1/responses/resp_1", "GET,DELETE", False),  # one route per method: every one named
    ("GET", "/v1/responses/resp_1/cancel", "POST", False),
    ("PUT", "/v1/conversations/conv_1", "GET,POST,DELETE", False),
    ("PUT", "/v1/conversations/conv_1/items", "GET,POST", False),
])
def test_a_wrong_method_is_a_405_with_allow(sim_gateway: Gateway, method: str, path: str, allow: str,
                                           anthropic: bool) -> None:
    response = httpx.request(method, sim_gateway.url + path, headers={"Authorization": "Bearer test"}, timeout=10)
    assert response.status_code == 405
    assert set(response.headers["allow"].replace(" ", "").split(",")) == set(allow.split(","))
    body = response.json()
    if anthropic:
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    else:
        assert body["error"]["type"] == "invalid_request_error" and body["error"]["message"]
