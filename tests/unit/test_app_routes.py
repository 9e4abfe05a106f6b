"""The app's wiring, in process: each client route declared once for FastAPI and the fast
path, both paths answering alike, and the admin API's key checks and error shapes."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator

import httpx
import pytest
from fastapi import FastAPI
from fastapi.routing import APIRoute

from deepinfer_gateway.config import ApiKey, GatewaySettings
from deepinfer_gateway.gateway.app import GatewayApp, create_app
from deepinfer_gateway.gateway.http.routes import COUNT_TOKENS_PATH, GENERATION_ROUTES
from deepinfer_gateway.gateway.serving.auth import hash_key

USER, ADMIN = "user-key", "admin-key"
SETTINGS = GatewaySettings(api_keys=(ApiKey(name="user", key_sha256=hash_key(USER)),
                                     ApiKey(name="admin", key_sha256=hash_key(ADMIN), admin=True)))
FAST_PATHS = {*GENERATION_ROUTES, COUNT_TOKENS_PATH}


@pytest.fixture(scope="module")
async def app() -> AsyncIterator[GatewayApp]:
    app = create_app(SETTINGS)
    async with app.router.lifespan_context(app):
        yield app


def client(app: GatewayApp, *, fast_path: bool = True) -> httpx.AsyncClient:
    """`fast_path=False` sends every request through FastAPI's own stack."""
    target = app if fast_path else functools.partial(FastAPI.__call__, app)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=target), base_url="http://gateway")


def test_each_fast_route_is_one_fastapi_route_with_the_same_endpoint(app: GatewayApp) -> None:
    assert set(app.fast_routes) == FAST_PATHS
    for path in FAST_PATHS:
        routes = [r for r in app.routes if isinstance(r, APIRoute) and r.path == path]
        assert len(routes) == 1, path
        assert routes[0].methods == {"POST"}
        assert routes[0].endpoint is app.fast_routes[path]


@pytest.mark.parametrize("fast_path", [True, False])
@pytest.mark.parametrize("path", sorted(FAST_PATHS))
async def test_fast_and_fastapi_paths_answer_alike(app: GatewayApp, path: str, fast_path: bool) -> None:
    async with client(app, fast_path=fast_path) as c:
        no_key = await c.post(path, json={})
        bad_body = await c.post(path, content=b"{", headers={"authorization": f"Bearer {USER}"})
    assert no_key.status_code == 401
    assert bad_body.status_code == 400
    anthropic = GENERATION_ROUTES.get(path) == "messages" or path == COUNT_TOKENS_PATH
    for r in (no_key, bad_body):
        body = r.json()
        assert (body["type"] == "error") if anthropic else ("message" in body["error"]), body


ADMIN_CALLS = [("GET", "/admin/workers", None), ("GET", "/admin/routing", None), ("GET", "/admin/index", None),
               ("POST", "/admin/workers", {"url": "http://127.0.0.1:9"}),
               ("DELETE", "/admin/workers/nope", None), ("PUT", "/admin/routing", {})]


@pytest.mark.parametrize(("method", "path", "body"), ADMIN_CALLS)
async def test_admin_needs_an_admin_key(app: GatewayApp, method: str, path: str, body: object) -> None:
    async with client(app) as c:
        missing = await c.request(method, path, json=body)
        user = await c.request(method, path, json=body, headers={"authorization": f"Bearer {USER}"})
    assert missing.status_code == 401 and missing.json()["error"]["type"] == "authentication_error"
    assert user.status_code == 403 and user.json()["error"]["type"] == "permission_error"


async def test_admin_reads_and_rejects_in_openai_error_json(app: GatewayApp) -> None:
    headers = {"authorization": f"Bearer {ADMIN}"}
    async with client(app) as c:
        workers = await c.get("/admin/workers", headers=headers)
        routing = await c.get("/admin/routing", headers=headers)
        unknown_policy = await c.put("/admin/routing", headers=headers, json={"policy": "no-such-policy"})
        extra_field = await c.put("/admin/routing", headers=headers, json={"polcy": "round_robin"})
        no_worker = await c.delete("/admin/workers/nope", headers=headers)
        bad_worker = await c.post("/admin/workers", headers=headers, json={"url": "ftp://x"})
    assert workers.status_code == 200 and workers.json() == {"workers": []}
    assert routing.status_code == 200 and routing.json()["policy"] == SETTINGS.router.policy.name
    for r in (unknown_policy, extra_field, bad_worker):
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    assert no_worker.status_code == 404 and "No worker nope" in no_worker.json()["error"]["message"]
