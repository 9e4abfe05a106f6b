"""A custom resource checked as the API server would admit it, offline: its CRD's own
openAPIV3Schema (structural: an unknown field is an error, as `kubectl apply --validate=strict`
makes it), the schema's defaults applied first, then every `x-kubernetes-validations` CEL rule
on the fields present, evaluated by cel-python. Transition rules (those naming oldSelf) apply to
updates only and are not evaluated here."""

from __future__ import annotations

import copy
import gzip
from pathlib import Path
from typing import Any

import celpy
import jsonschema
import yaml
from celpy.adapter import json_to_cel


def load_crd(path: Path) -> dict[str, Any]:
    text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
    (crd,) = [d for d in yaml.safe_load_all(text) if d]
    assert crd["kind"] == "CustomResourceDefinition", path
    return dict(crd)


def version_schema(crd: dict[str, Any], api_version: str) -> dict[str, Any]:
    group, _, version = api_version.partition("/")
    assert crd["spec"]["group"] == group, (crd["spec"]["group"], api_version)
    (found,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    assert found["served"], api_version
    return dict(found["schema"]["openAPIV3Schema"])


def strict(schema: Any) -> Any:
    """The schema with unknown fields refused where the API server prunes or rejects them: every
    object that lists its properties and neither keeps unknown fields nor declares a map."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items() if k != "x-kubernetes-validations"}
    if "properties" in schema and "additionalProperties" not in schema \
            and not schema.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


def with_defaults(schema: dict[str, Any], value: Any) -> Any:
    """`value` with the schema's defaults filled in where a field is absent, as the API server
    does before validating."""
    if isinstance(value, dict) and "properties" in schema:
        out = dict(value)
        for name, sub in schema["properties"].items():
            if name not in out and "default" in sub:
                out[name] = copy.deepcopy(sub["default"])
            if name in out:
                out[name] = with_defaults(sub, out[name])
        return out
    if isinstance(value, dict) and isinstance(schema.get("additionalProperties"), dict):
        return {k: with_defaults(schema["additionalProperties"], v) for k, v in value.items()}
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [with_defaults(schema["items"], v) for v in value]
    return value


def cel_failures(schema: dict[str, Any], value: Any, path: str = "") -> list[str]:
    """The messages of the CEL rules `value` breaks, each with the path of its node."""
    failures: list[str] = []
    env = celpy.Environment()
    for rule in schema.get("x-kubernetes-validations", []):
        if "oldSelf" in rule["rule"]:
            continue
        program = env.program(env.compile(rule["rule"]))
        result = program.evaluate({"self": json_to_cel(value)})
        if not isinstance(result, celpy.celtypes.BoolType) or not result:  # an error (a CelEvalError) fails too
            failures.append(f"{path or '.'}: {rule.get('message', rule['rule'])} ({result!r})")
    if isinstance(value, dict) and "properties" in schema:
        for name, sub in schema["properties"].items():
            if name in value:
                failures += cel_failures(sub, value[name], f"{path}.{name}")
    elif isinstance(value, dict) and isinstance(schema.get("additionalProperties"), dict):
        for key, item in value.items():
            failures += cel_failures(schema["additionalProperties"], item, f"{path}.{key}")
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            failures += cel_failures(schema["items"], item, f"{path}[{i}]")
    return failures


def problems(crd: dict[str, Any], obj: dict[str, Any]) -> list[str]:
    """Everything the API server would refuse in `obj` (empty: admitted), per its CRD."""
    assert obj["kind"] == crd["spec"]["names"]["kind"], (obj["kind"], crd["spec"]["names"]["kind"])
    schema = version_schema(crd, obj["apiVersion"])
    defaulted = with_defaults(schema, obj)
    validator = jsonschema.Draft7Validator(strict(schema))
    found = [f"{'.'.join(map(str, e.absolute_path)) or '.'}: {e.message}" for e in validator.iter_errors(defaulted)]
    return found + cel_failures(schema, defaulted)
