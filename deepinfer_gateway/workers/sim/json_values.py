"""Minimal JSON values that satisfy a JSON schema: what the sim "generates" under a
structured-output constraint or for tool-call arguments.

Covers the keywords tool schemas use (type, properties, required, enum, const,
anyOf/oneOf/allOf, items, minItems, minimum, minLength, format); `$ref` and
patterns are not followed. Deterministic: the same schema gives the same value.
"""

from __future__ import annotations

from typing import Any

_STRINGS = {"city": "Paris", "location": "Paris", "query": "weather in Paris", "date": "2025-01-01"}
_FORMATS = {"date": "2025-01-01", "date-time": "2025-01-01T00:00:00Z", "email": "a@example.com", "uri": "https://example.com"}


def example_value(schema: Any, name: str = "") -> Any:
    if not isinstance(schema, dict):
        return {}
    if "const" in schema:
        return schema["const"]
    if schema.get("enum"):
        return schema["enum"][0]
    for key in ("anyOf", "oneOf"):
        if schema.get(key):
            return example_value(schema[key][0], name)
    if schema.get("allOf"):
        merged: dict[str, Any] = {}
        for part in schema["allOf"]:
            merged |= part if isinstance(part, dict) else {}
        return example_value(merged, name)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind is None:
        kind = "object" if "properties" in schema else "array" if "items" in schema else "string"
    if kind == "object":
        props = schema.get("properties", {})
        wanted = schema.get("required") or list(props)[:1]
        return {key: example_value(props.get(key, {}), key) for key in wanted}
    if kind == "array":
        count = max(1, int(schema.get("minItems", 1)))
        return [example_value(schema.get("items", {}), name) for _ in range(count)]
    if kind == "integer":
        return int(schema.get("minimum", 1))
    if kind == "number":
        return float(schema.get("minimum", 1.5))
    if kind == "boolean":
        return True
    if kind == "null":
        return None
    text = _FORMATS.get(schema.get("format", ""), _STRINGS.get(name.lower(), "example"))
    return text.ljust(int(schema.get("minLength", 0)), "x")
