"""The client APIs the EPP routes, and the refusal of every other request.

The data plane forwards what the EPP routes to a worker with the workers' token (Envoy
Gateway's credential injection), and a worker serves its own protocol beside the client
APIs (`/v1/worker/*`: every tenant's KV block hashes, aborts, raw generation; `/load`,
`/info`). So the EPP routes the client APIs alone, by exact path and method, and answers
anything else itself (404, or 405 for a known path with another method), whatever the
route in front of it lets through. Stored Responses (`/v1/responses/{id}`) are not among
them: each engine keeps its own, and the EPP spreads requests over engines.
"""

from __future__ import annotations

from deepinfer_gateway.core.errors import GatewayError
from deepinfer_gateway.gateway.http.routes import GENERATION_ROUTES

MODELS_PATH = "/v1/models"

# path -> the methods it answers; the same list as deploy/k8s/epp/httproute.yaml and deploy/envoy's routes.
CLIENT_ROUTES: dict[str, frozenset[str]] = {
    **{path: frozenset({"POST"}) for path in GENERATION_ROUTES},
    MODELS_PATH: frozenset({"GET"}),
}


def client_route_refusal(method: str, path: str) -> GatewayError | None:
    """None for a client API request; else the error that answers it (query string ignored)."""
    methods = CLIENT_ROUTES.get(path.split("?", 1)[0])
    if methods is None:
        return GatewayError(f"Not found: {path.split('?', 1)[0]!r} is not an API of this endpoint.",
                            status_code=404, code="not_found")
    if method not in methods:
        allowed = ", ".join(sorted(methods))
        return GatewayError(f"Method {method} not allowed here; use {allowed}.", status_code=405,
                            code="method_not_allowed", headers={"allow": allowed})
    return None
