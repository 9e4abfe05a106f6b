"""What `/openapi.json` says about each route, beyond what FastAPI infers: request bodies,
success and error answers, content types.

The generation routes read raw bodies (deepseek-recipe parses them, not pydantic), so FastAPI
sees no body. Their schemas are built here from the same tables that decide what is accepted
(recipe_bridge/fields.py's FIELDS, completions.py's CompletionRequest): a field is in the schema
exactly when the gateway honours it (or refuses it only at some values), and any other field is
refused with a 400 (`additionalProperties: false`). Pure: `document(spec)` rewrites the dict
FastAPI generated.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST

from deepinfer_gateway.recipe_bridge.completions import CompletionRequest
from deepinfer_gateway.recipe_bridge.fields import COUNT_TOKENS_FIELDS, FIELDS
from deepinfer_gateway.recipe_bridge.includes import HONOURED
from deepinfer_gateway.recipe_bridge.prepared import ApiProtocol

JSON = "application/json"
SSE = "text/event-stream"
Schema = dict[str, Any]
REF = "#/components/schemas/{model}"  # pydantic ref_template: $defs land in components

_STRING: Schema = {"type": "string"}
_BOOL: Schema = {"type": "boolean"}
_NUMBER: Schema = {"type": "number"}
_INT: Schema = {"type": "integer"}
_OBJECT: Schema = {"type": "object"}
_ARRAY: Schema = {"type": "array"}
_STRINGS: Schema = {"type": "array", "items": _STRING}
_STRING_OR_OBJECT: Schema = {"oneOf": [_STRING, _OBJECT]}
_CONTENT: Schema = {"oneOf": [_STRING, {"type": "array", "items": _OBJECT}]}


def _messages(roles: list[str]) -> Schema:
    """A conversation: at least one message, each with a role deepseek-recipe knows and content."""
    message = {"type": "object", "required": ["role", "content"],
               "properties": {"role": {"type": "string", "enum": roles}, "content": _CONTENT}}
    return {"type": "array", "minItems": 1, "items": message}


_CHAT_ROLES = ["system", "user", "assistant", "tool", "latest_reminder"]
_MESSAGES_ROLES = ["user", "assistant"]
_POSITIVE: Schema = {"type": "integer", "minimum": 1}

# The JSON type of every field FIELDS names; deep shapes (messages, tools) stay loose, as
# deepseek-recipe checks them and answers a 400.
FIELD_TYPES: dict[str, Schema] = {
    "model": _STRING, "stream": _BOOL, "temperature": {"type": "number", "minimum": 0, "maximum": 2},
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "tools": {"type": "array", "items": _OBJECT}, "tool_choice": _STRING_OR_OBJECT, "metadata": _OBJECT,
    "ignore_eos": _BOOL, "min_tokens": {"type": "integer", "minimum": 0},
    "messages": _messages(_CHAT_ROLES),  # Anthropic's roles: _PROTOCOL_TYPES
    "max_tokens": _POSITIVE, "max_completion_tokens": _POSITIVE, "max_output_tokens": _POSITIVE,
    "stop": {"oneOf": [_STRING, _STRINGS]}, "stop_sequences": _STRINGS, "seed": _INT,
    "logprobs": _BOOL, "top_logprobs": _INT, "response_format": _OBJECT, "n": _INT, "user": _STRING,
    "stream_options": _OBJECT, "thinking": _OBJECT, "reasoning_effort": _STRING,
    "top_k": {"type": "integer", "minimum": -1},
    "safety_identifier": _STRING, "prompt_cache_key": _STRING, "parallel_tool_calls": _BOOL,
    "cache_salt": {"type": "string", "minLength": 1, "maxLength": 256},
    "service_tier": _STRING, "store": _BOOL, "modalities": _STRINGS, "audio": _OBJECT, "prediction": _OBJECT,
    "web_search_options": _OBJECT, "verbosity": _STRING, "functions": {"type": "array", "items": _OBJECT},
    "function_call": _STRING_OR_OBJECT,
    "presence_penalty": _NUMBER, "frequency_penalty": _NUMBER, "repetition_penalty": _NUMBER, "min_p": _NUMBER,
    "logit_bias": _OBJECT,
    "input": {"oneOf": [_STRING, {"type": "array", "items": _OBJECT}]}, "instructions": _STRING,
    "text": _OBJECT, "reasoning": _OBJECT, "previous_response_id": _STRING, "background": _BOOL,
    "conversation": _STRING_OR_OBJECT, "truncation": _STRING, "include": _STRINGS, "max_tool_calls": _INT,
    "prompt": _OBJECT,
    "system": {"oneOf": [_STRING, {"type": "array", "items": _OBJECT}]},
    "container": _STRING_OR_OBJECT, "mcp_servers": {"type": "array", "items": _OBJECT},
    "context_management": _OBJECT,
}

# Per protocol, where a field's shape differs from FIELD_TYPES.
_PROTOCOL_TYPES: dict[ApiProtocol, dict[str, Schema]] = {
    ApiProtocol.MESSAGES: {"messages": _messages(_MESSAGES_ROLES)},
}

_REQUIRED: dict[ApiProtocol, list[str]] = {
    ApiProtocol.CHAT: ["model", "messages"],
    ApiProtocol.RESPONSES: ["model", "input"],
    ApiProtocol.MESSAGES: ["model", "messages", "max_tokens"],
}


def body_schema(protocol: ApiProtocol, models: tuple[str, ...] = ()) -> Schema:
    """The request body `protocol`'s route accepts: every field of FIELDS[protocol], no other.
    `models`: the names served (any other is a 404), as the `model` enum."""
    if protocol is ApiProtocol.COMPLETIONS:
        schema = CompletionRequest.model_json_schema(ref_template=REF)
    else:
        schema = {"type": "object", "additionalProperties": False, "required": _REQUIRED[protocol],
                  "properties": {name: _PROTOCOL_TYPES.get(protocol, {}).get(name, FIELD_TYPES[name])
                                 for name in FIELDS[protocol]}}
    if models:
        schema["properties"]["model"] = {"type": "string", "enum": list(models)}
    return schema


def count_tokens_schema(models: tuple[str, ...] = ()) -> Schema:
    """`/v1/messages/count_tokens`: a Messages body's prompt fields; `max_tokens` is not needed."""
    schema = body_schema(ApiProtocol.MESSAGES, models)
    schema["properties"] = {name: schema["properties"][name] for name in COUNT_TOKENS_FIELDS}
    schema["required"] = ["model", "messages"]
    return schema


OPENAI_ERROR: Schema = {
    "type": "object", "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["message", "type"], "properties": {
        "message": _STRING, "type": _STRING, "param": {"type": ["string", "null"]},
        "code": {"type": ["string", "null"]}}}},
}
ANTHROPIC_ERROR: Schema = {
    "type": "object", "required": ["type", "error"],
    "properties": {"type": {"const": "error"}, "error": {"type": "object", "required": ["type", "message"],
                                                         "properties": {"type": _STRING, "message": _STRING}}},
}
_DESCRIPTIONS = {
    200: "Success", 201: "Created", 400: "Invalid request (a field refused, malformed JSON)",
    401: "Missing or invalid API key", 403: "The key may not use this model or endpoint", 404: "Not found",
    405: "Method not allowed (Allow header lists the allowed ones)", 413: "Request body too large",
    429: "Rate limited", 500: "Internal error", 502: "A worker failed", 503: "No healthy worker or overloaded",
    504: "A worker did not answer in time",
}
_GENERATION_ERRORS = (400, 401, 403, 404, 405, 413, 429, 500, 502, 503, 504)


def _errors(statuses: tuple[int, ...], error: Schema) -> dict[str, Schema]:
    return {str(s): {"description": _DESCRIPTIONS[s], "content": {JSON: {"schema": error}}} for s in statuses}


def _ok(status: int = 200, stream: bool = False) -> dict[str, Schema]:
    content: Schema = {JSON: {"schema": _OBJECT}}
    if stream:
        content[SSE] = {"schema": _STRING}
    return {str(status): {"description": _DESCRIPTIONS[status], "content": content}}


def _body(schema: Schema) -> Schema:
    return {"required": True, "content": {JSON: {"schema": schema}}}


def _query(name: str, schema: Schema, description: str) -> Schema:
    return {"name": name, "in": "query", "required": False, "schema": schema, "description": description}


# The reads of stored responses and conversation items: what `include` adds (the OpenAI SDK
# sends it as `include[]`, which the gateway reads too; any other value is a 400) and the pages.
_INCLUDE = _query("include", {"type": "array", "items": {"type": "string", "enum": list(HONOURED)}},
                  "Output to add to the items shown: logprobs kept with the response (the gateway also reads "
                  "include[]; any other value is a 400).")
_PAGE = [
    _query("after", _STRING, "An item id: the page starts after it."),
    _query("limit", {"type": "integer", "minimum": 1, "maximum": 100, "default": 20}, "Items per page."),
    _query("order", {"type": "string", "enum": ["asc", "desc"], "default": "desc"}, "Oldest first (asc) or not."),
]
_RETRIEVE = [
    _query("stream", {"type": "boolean", "default": False},
           "A background response created with stream: true: its events again, as they were sent."),
    _query("starting_after", {"type": "integer", "minimum": 0},
           "With stream=true: only the events after this sequence number."),
]


def _operations(admin_bodies: Mapping[tuple[str, str], Schema], models: tuple[str, ...]
                ) -> dict[tuple[str, str], Schema]:
    """(path, method) -> the operation fields that replace FastAPI's."""
    ops: dict[tuple[str, str], Schema] = {}
    paths = {ApiProtocol.CHAT: "/v1/chat/completions", ApiProtocol.RESPONSES: "/v1/responses",
             ApiProtocol.COMPLETIONS: "/v1/completions", ApiProtocol.MESSAGES: "/v1/messages"}
    for protocol, path in paths.items():
        error = ANTHROPIC_ERROR if protocol is ApiProtocol.MESSAGES else OPENAI_ERROR
        ops[path, "post"] = {"requestBody": _body(body_schema(protocol, models)),
                             "responses": {**_ok(stream=True), **_errors(_GENERATION_ERRORS, error)}}
    ops["/v1/messages/count_tokens", "post"] = {
        "requestBody": _body(count_tokens_schema(models)),
        "responses": {**_ok(), **_errors((400, 401, 403, 404, 405, 413, 429, 500), ANTHROPIC_ERROR)}}
    model_answers = {**_ok(), **_errors((401, 404, 405, 500), OPENAI_ERROR)}
    ops["/v1/models", "get"] = {"responses": model_answers}
    ops["/v1/models/{model_id}", "get"] = {"responses": model_answers}
    stored = {**_ok(), **_errors((400, 401, 404, 405, 500, 503), OPENAI_ERROR)}
    for path in ("/v1/responses/{response_id}", "/v1/responses/{response_id}/input_items"):
        for method in ("get", "delete"):
            ops[path, method] = {"responses": stored}
    ops["/v1/responses/{response_id}/input_items", "get"]["parameters"] = [_INCLUDE, *_PAGE]
    ops["/v1/responses/{response_id}", "get"] = {  # stream=true: a background response's events
        "responses": {**_ok(stream=True), **_errors((400, 401, 404, 405, 500, 503), OPENAI_ERROR)},
        "parameters": [_INCLUDE, *_RETRIEVE]}
    ops["/v1/responses/{response_id}/cancel", "post"] = {"responses": stored}
    conversation_answers = {**_ok(), **_errors((400, 401, 404, 405, 413, 500, 503), OPENAI_ERROR)}
    items: Schema = {"type": "array", "maxItems": 20, "items": {"type": "object"}}
    metadata: Schema = {"type": "object", "maxProperties": 16, "additionalProperties": _STRING}
    conversation_bodies = {
        ("/v1/conversations", "post"): {"type": "object", "properties": {"items": items, "metadata": metadata}},
        ("/v1/conversations/{conversation_id}", "post"): {"type": "object", "required": ["metadata"],
                                                          "properties": {"metadata": metadata}},
        ("/v1/conversations/{conversation_id}/items", "post"): {"type": "object", "required": ["items"],
                                                                "properties": {"items": items}},
    }
    for path in ("/v1/conversations", "/v1/conversations/{conversation_id}",
                 "/v1/conversations/{conversation_id}/items", "/v1/conversations/{conversation_id}/items/{item_id}"):
        for method in ("get", "post", "delete"):
            ops[path, method] = {"responses": conversation_answers}
            if (path, method) in conversation_bodies:
                ops[path, method]["requestBody"] = _body(conversation_bodies[path, method])
    ops["/v1/conversations/{conversation_id}/items", "get"]["parameters"] = [_INCLUDE, *_PAGE]
    ops["/v1/conversations/{conversation_id}/items", "post"]["parameters"] = [_INCLUDE]
    ops["/v1/conversations/{conversation_id}/items/{item_id}", "get"]["parameters"] = [_INCLUDE]
    ops["/health", "get"] = {"responses": {**_ok(), **_errors((405,), OPENAI_ERROR)}}
    ops["/ready", "get"] = {"responses": {
        **_ok(), "503": {"description": "No healthy worker, or shutting down", "content": {JSON: {"schema": _OBJECT}}},
        **_errors((405,), OPENAI_ERROR)}}
    ops["/metrics", "get"] = {"responses": {
        "200": {"description": "Prometheus text exposition", "content": {CONTENT_TYPE_LATEST: {"schema": _STRING}}},
        **_errors((405,), OPENAI_ERROR)}}
    admin_errors = _errors((400, 401, 403, 404, 405, 500, 503), OPENAI_ERROR)
    for path in ("/admin/workers", "/admin/index", "/admin/routing", "/admin/workers/{worker_id}"):
        for method in ("get", "post", "put", "delete"):
            status = 201 if (path, method) == ("/admin/workers", "post") else 200
            op: Schema = {"responses": {**_ok(status), **admin_errors}}
            if (path, method) in admin_bodies:
                op["requestBody"] = _body(admin_bodies[path, method])
            ops[path, method] = op
    return ops


def document(spec: Schema, admin_bodies: Mapping[tuple[str, str], Schema] | None = None,
             models: tuple[str, ...] = ()) -> Schema:
    """`spec` (FastAPI's document) with every known operation's body and answers described.
    `admin_bodies`: (path, method) -> the pydantic JSON schema of an admin route's body;
    `models`: the model names (and aliases) served."""
    spec = copy.deepcopy(spec)
    ops = _operations(admin_bodies or {}, models)
    components = spec.setdefault("components", {}).setdefault("schemas", {})
    components.update(CompletionRequest.model_json_schema(ref_template=REF)
                      .pop("$defs", {}))
    for (path, method), fields in ops.items():
        operation = spec.get("paths", {}).get(path, {}).get(method)
        if operation is None:
            continue
        fields = dict(fields)
        added = fields.pop("parameters", [])
        operation.update(fields)
        if added:  # beside the path parameters FastAPI found
            operation["parameters"] = [*operation.get("parameters", []), *added]
        if "requestBody" in fields:
            defs = fields["requestBody"]["content"][JSON]["schema"].pop("$defs", {})
            components.update(defs)
    return spec
