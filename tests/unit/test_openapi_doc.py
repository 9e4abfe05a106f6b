"""`/openapi.json`: request bodies from the tables that decide what is accepted, and every
route's answers with their content types."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import CONTENT_TYPE_LATEST

from deepinfer_gateway.config import GatewaySettings
from deepinfer_gateway.gateway.app import create_app
from deepinfer_gateway.gateway.http.openapi_doc import ANTHROPIC_ERROR, FIELD_TYPES, OPENAI_ERROR, body_schema
from deepinfer_gateway.gateway.http.routes import GENERATION_ROUTES
from deepinfer_gateway.recipe_bridge.completions import CompletionRequest
from deepinfer_gateway.recipe_bridge.fields import COUNT_TOKENS_FIELDS, FIELDS
from deepinfer_gateway.recipe_bridge.includes import HONOURED
from deepinfer_gateway.recipe_bridge.prepared import ApiProtocol


@pytest.fixture(scope="module")
def spec() -> dict[str, Any]:
    return create_app(GatewaySettings()).openapi()


def body_of(spec: dict[str, Any], path: str) -> dict[str, Any]:
    return spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]


@pytest.mark.parametrize("protocol", [ApiProtocol.CHAT, ApiProtocol.RESPONSES, ApiProtocol.MESSAGES])
def test_a_body_schema_names_exactly_the_fields_the_gateway_accepts(protocol: ApiProtocol) -> None:
    schema = body_schema(protocol)
    assert set(schema["properties"]) == set(FIELDS[protocol])
    assert schema["additionalProperties"] is False
    assert {"model"} <= set(schema["required"]) <= set(FIELDS[protocol])


def test_every_field_has_a_type() -> None:
    names = {name for fields in FIELDS.values() for name in fields}
    assert names <= set(FIELD_TYPES), names - set(FIELD_TYPES)


def test_the_live_document_carries_each_generation_body(spec: dict[str, Any]) -> None:
    for path, protocol in GENERATION_ROUTES.items():
        schema = body_of(spec, path)
        expected = set(CompletionRequest.model_fields) if protocol is ApiProtocol.COMPLETIONS else set(FIELDS[protocol])
        assert set(schema["properties"]) == expected, path
        assert schema["additionalProperties"] is False
    assert body_of(spec, "/v1/messages")["required"] == ["model", "messages", "max_tokens"]
    assert body_of(spec, "/v1/completions")["required"] == ["model", "prompt"]
    count_tokens = body_of(spec, "/v1/messages/count_tokens")
    assert count_tokens["required"] == ["model", "messages"]
    assert set(count_tokens["properties"]) == set(COUNT_TOKENS_FIELDS) and count_tokens["additionalProperties"] is False
    assert "WorkerSpec" in str(spec["paths"]["/admin/workers"]["post"]["requestBody"])
    assert "RoutingUpdate" in str(spec["paths"]["/admin/routing"]["put"]["requestBody"])


def test_every_ref_resolves(spec: dict[str, Any]) -> None:
    refs: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("$ref"), str):
                refs.append(node["$ref"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(spec)
    assert refs
    for ref in refs:
        assert ref.startswith("#/components/schemas/")
        assert ref.rsplit("/", 1)[1] in spec["components"]["schemas"], ref


def test_errors_and_content_types(spec: dict[str, Any]) -> None:
    chat = spec["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert set(chat["200"]["content"]) == {"application/json", "text/event-stream"}
    assert {"400", "401", "403", "404", "413", "429", "500", "502", "503"} <= set(chat)
    assert chat["400"]["content"]["application/json"]["schema"] == OPENAI_ERROR
    messages = spec["paths"]["/v1/messages"]["post"]["responses"]
    assert messages["400"]["content"]["application/json"]["schema"] == ANTHROPIC_ERROR
    assert list(spec["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == [CONTENT_TYPE_LATEST]
    assert "503" in spec["paths"]["/ready"]["get"]["responses"]
    for path, item in spec["paths"].items():
        for method, operation in item.items():
            assert "422" not in operation["responses"], (path, method)  # FastAPI's default: never answered
            assert any(code.startswith("4") for code in operation["responses"]), (path, method)


def test_the_reads_of_stored_items_describe_their_query_parameters(spec: dict[str, Any]) -> None:
    def query(path: str, method: str = "get") -> dict[str, Any]:
        params = spec["paths"][path][method]["parameters"]
        return {p["name"]: p["schema"] for p in params if p["in"] == "query"}

    pages = {"after", "limit", "order"}
    assert set(query("/v1/responses/{response_id}")) == {"include", "stream", "starting_after"}
    assert set(query("/v1/responses/{response_id}/input_items")) == {"include"} | pages
    assert set(query("/v1/conversations/{conversation_id}/items")) == {"include"} | pages
    assert set(query("/v1/conversations/{conversation_id}/items", "post")) == {"include"}
    assert set(query("/v1/conversations/{conversation_id}/items/{item_id}")) == {"include"}
    assert query("/v1/responses/{response_id}")["include"]["items"]["enum"] == list(HONOURED)
    assert query("/v1/conversations/{conversation_id}/items")["limit"] == {
        "type": "integer", "minimum": 1, "maximum": 100, "default": 20}
    # the path parameters FastAPI found are still there
    item = spec["paths"]["/v1/conversations/{conversation_id}/items/{item_id}"]["get"]
    names = [p["name"] for p in item["parameters"]]
    assert names[:2] == ["conversation_id", "item_id"]
