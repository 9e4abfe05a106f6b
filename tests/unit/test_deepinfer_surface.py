"""The wrapper and the interface double against the real DeepInfer surface.

tests/data/deepinfer_surface.json is read from the deepinfer 0.1.0 sdist by
`python -m tests.deepinfer_surface` (see there). Here, offline: every DeepInfer name the
wrapper (deepinfer_gateway/workers/deepinfer/) reaches and every call it makes binds to the
real signature, and the double (tests/deepinfer_double/) offers nothing the real one lacks
beyond the test hooks it declares.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from deepinfer_gateway.core.protocol import FinishReason, Sampling, StructuredOutput
from deepinfer_gateway.workers import deepinfer as wrapper
from deepinfer_gateway.workers.deepinfer import api, mapping, stepper
from deepinfer_gateway.workers.deepinfer.config import DeepInferConfig
from tests import deepinfer_surface as surface
from tests.deepinfer_double import core as double_core

SNAPSHOT = surface.load()
REAL: dict[str, Any] = SNAPSHOT["classes"]
WRAPPER_DIR = Path(wrapper.__file__).parent
DOUBLE_SOURCE = Path(double_core.__file__)

# How the wrapper's modules spell DeepInfer objects (receiver source text -> class). Each entry
# must match somewhere (test_every_receiver_is_used), so a rename cannot hide a call.
RECEIVERS = {
    "self._llm": "LLMEngine",
    "llm": "LLMEngine",
    "self._engine_cls": "LLMEngine",
    "super()": "LLMEngine",
    "ro": "RequestOutput",
    "seq": "Sequence",
    "live.seq": "Sequence",
    "scheduler": "Scheduler",
    "manager": "BlockManager",
    "getattr(llm, 'cache_config', None)": "CacheConfig",
}
SUBCLASSED = {"base": "LLMEngine"}  # transfer.pd_engine_class subclasses the LLMEngine it is given


@dataclass(frozen=True)
class Use:
    where: str
    receiver: str
    cls: str
    name: str
    positional: int | None = None  # a call: its positional count and keyword names;
    keywords: tuple[str, ...] = ()  # None when not a call or when it spreads *args/**kwargs


def _call_shape(call: ast.Call) -> tuple[int | None, tuple[str, ...]]:
    if any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords):
        return None, ()
    return len(call.args), tuple(k.arg for k in call.keywords if k.arg is not None)


def wrapper_uses() -> list[Use]:
    """Attribute reads, `getattr(x, "name")` and method calls on DeepInfer objects in the wrapper."""
    uses: list[Use] = []
    for path in sorted(WRAPPER_DIR.glob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        calls = {id(n.func): n for n in ast.walk(tree) if isinstance(n, ast.Call)}
        for node in ast.walk(tree):
            where = f"{path.name}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Attribute) and not node.attr.startswith("__"):
                receiver = ast.unparse(node.value)
                cls = RECEIVERS.get(receiver)
                if cls is None:
                    continue
                call = calls.get(id(node))
                positional, keywords = _call_shape(call) if call is not None else (None, ())
                uses.append(Use(where, receiver, cls, node.attr, positional, keywords))
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
                  and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)):
                receiver = ast.unparse(node.args[0])
                cls = RECEIVERS.get(receiver)
                if cls is not None:
                    uses.append(Use(where, receiver, cls, str(node.args[1].value)))
    return uses


def bind_error(params: list[list[Any]], positional: int, keywords: tuple[str, ...]) -> str | None:
    """Why a call with `positional` arguments and `keywords` would not bind to `params`."""
    by_position = [p for p in params if p[1] in ("positional_only", "positional_or_keyword")]
    if positional > len(by_position) and not any(p[1] == "var_positional" for p in params):
        return f"{positional} positional arguments, at most {len(by_position)}"
    bound = {p[0] for p in by_position[:positional]}
    for name in keywords:
        if not any(p[0] == name and p[1] in ("positional_or_keyword", "keyword_only") for p in params):
            if not any(p[1] == "var_keyword" for p in params):
                return f"no parameter {name!r}"
        if name in bound:
            return f"{name!r} given twice"
        bound.add(name)
    missing = [p[0] for p in params if p[2] is None and p[1] not in ("var_positional", "var_keyword")
               and p[0] not in bound]
    return f"missing {missing}" if missing else None


def _kwargs_error(cls: str, kwargs: dict[str, Any]) -> str | None:
    return bind_error(REAL[cls]["init"], 0, tuple(kwargs))


def double_surface() -> dict[str, Any]:
    tree = ast.parse(DOUBLE_SOURCE.read_text())
    return {name: surface.class_surface(tree, name, with_init) for name, (_, _, with_init) in surface.CLASSES.items()}


# --- the snapshot ---------------------------------------------------------------------------


def test_snapshot_is_the_release_the_wrapper_installs() -> None:
    assert f"deepinfer=={SNAPSHOT['version']}" in api.INSTALL_HINT
    sdist = SNAPSHOT["sdist"]
    assert sdist["filename"] == f"deepinfer-{SNAPSHOT['version']}.tar.gz" and len(sdist["sha256"]) == 64
    assert set(REAL) == set(surface.CLASSES)


def test_wrapper_imports_each_name_from_its_real_module() -> None:
    for attr, (module, name) in api._PATHS.items():
        assert REAL[name]["module"] == f"deepinfer.{module}", attr


# --- the wrapper's calls --------------------------------------------------------------------


def test_every_receiver_is_used() -> None:
    assert {u.receiver for u in wrapper_uses()} == set(RECEIVERS)


def test_every_name_the_wrapper_reaches_is_real() -> None:
    uses = wrapper_uses()
    names = {(u.cls, u.name) for u in uses}
    # The core of the serving loop, so that a scan that finds nothing cannot pass.
    assert {("LLMEngine", "add_request"), ("LLMEngine", "step"), ("LLMEngine", "flush_inflight_reqs"),
            ("LLMEngine", "abort_request"), ("LLMEngine", "from_engine_args"), ("LLMEngine", "close"),
            ("RequestOutput", "get_token_id"), ("RequestOutput", "get_finish_reason")} <= names
    unknown = []
    for u in uses:
        real = REAL[u.cls]
        if u.name not in real["methods"] and u.name not in real["attributes"] and u.name not in real.get("members", []):
            unknown.append(f"{u.where}: {u.cls}.{u.name}")
    assert unknown == []


def test_every_call_the_wrapper_makes_binds_to_the_real_signature() -> None:
    errors, checked = [], 0
    for u in wrapper_uses():
        method = REAL[u.cls]["methods"].get(u.name)
        if method is None or u.positional is None:
            continue
        checked += 1
        error = bind_error(method["params"], u.positional, u.keywords)
        if error:
            errors.append(f"{u.where}: {u.cls}.{u.name}: {error}")
    assert errors == [] and checked >= 15


def test_hooks_the_wrapper_overrides_keep_the_real_signatures() -> None:
    overrides = []
    for path in WRAPPER_DIR.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef) or not any(ast.unparse(b) in SUBCLASSED for b in node.bases):
                continue
            methods = [item for item in node.body if isinstance(item, ast.FunctionDef)]
            overrides += [(item.name, surface._params(item.args, drop_first=True)) for item in methods]
    assert {name for name, _ in overrides} == {"pe_prepare_save_kvcache", "pe_do_save_kvcache"}
    for name, params in overrides:
        assert REAL["LLMEngine"]["methods"][name]["params"] == params, name


def test_sampling_params_take_every_keyword_the_wrapper_passes() -> None:
    so = StructuredOutput(schema_type="json", schema_='{"type": "object"}')
    kwargs = mapping.sampling_kwargs(Sampling(max_tokens=5, top_k=3, top_logprobs=2, seq_seed=7, so_args=so))
    assert "so_args" in kwargs and _kwargs_error("SamplingParams", kwargs) is None


def test_engine_args_take_every_keyword_the_wrapper_passes() -> None:
    kwargs = DeepInferConfig(model="/m", engine_args={"seed": 3}).engine_args_kwargs("NORMAL")
    assert _kwargs_error("EngineArgs", kwargs) is None
    assert set(stepper.ENGINE_TYPES.values()) <= set(REAL["EngineType"]["members"])


def test_every_real_finish_reason_has_a_meaning() -> None:
    reasons = SNAPSHOT["finish_reasons"]
    assert {"stop", "length", "abort"} <= set(reasons)
    assert set(mapping._PLAIN) | set(mapping._ERRORS) == set(reasons)
    for reason in reasons:
        protocol_reason, kind, message = mapping.map_finish(reason)
        assert protocol_reason is not FinishReason.ERROR or (kind is not None and "unknown" not in (message or ""))


# --- the double -----------------------------------------------------------------------------


def test_double_offers_nothing_the_real_one_lacks() -> None:
    assert surface.extras(REAL, double_surface(), double_core.TEST_HOOKS) == []


def test_double_test_hooks_are_double_only_and_exist() -> None:
    double = double_surface()
    for cls, names in double_core.TEST_HOOKS.items():
        have = set(double[cls]["methods"]) | set(double[cls]["attributes"])
        real = set(REAL[cls]["methods"]) | set(REAL[cls]["attributes"])
        assert names <= have and not names & real, cls


def test_double_finish_reasons_are_real() -> None:
    assert set(double_core.TRIGGERS.values()) <= set(SNAPSHOT["finish_reasons"])


def test_double_mirrors_the_module_layout() -> None:
    loaded = api.load_api("tests.deepinfer_double")
    for attr in api._PATHS:
        assert getattr(loaded, attr) is getattr(double_core, attr)


# --- the comparison itself ------------------------------------------------------------------

_REAL_SAMPLE = '''
class E:
    def __init__(self, a, b=1):
        self.x = a
    def run(self, /, rid, enqueue=True): ...
    @property
    def load(self): ...
'''


@pytest.mark.parametrize(
    ("other", "expected"),
    [
        ("def run(self, /, rid, enqueue=True): ...", []),
        ("def run(self, /, rid, enqueue=False): ...", ["E.run: method(rid, enqueue=False)"]),
        ("def run(self, /, request_id, enqueue=True): ...", ["E.run: method(request_id, enqueue=True)"]),
        ("def stop(self): ...", ["E.stop()"]),
        ("def __init__(self):\n        self.y = 0", ["E.y"]),
        ("def __init__(self, b=2, a=0): ...", ["E(b=2) at 0", "E(a=0) at 1"]),
    ],
)
def test_extras_reports_every_difference(other: str, expected: list[str]) -> None:
    real = {"E": surface.class_surface(ast.parse(_REAL_SAMPLE), "E", with_init=True)}
    mine = {"E": surface.class_surface(ast.parse(f"class E:\n    {other}\n"), "E", with_init=True)}
    lines = surface.extras(real, mine)
    assert [line.split(" where")[0] for line in lines] == expected


def test_bind_error_reports_bad_calls() -> None:
    params = REAL["LLMEngine"]["methods"]["add_request"]["params"]
    assert bind_error(params, 4, ("multi_modal_data", "enqueue")) is None
    assert bind_error(params, 4, ("enque",)) == "no parameter 'enque'"
    assert bind_error(params, 3, ()) == "missing ['prompt_token_ids']"
    assert bind_error(params, 10, ()) == "10 positional arguments, at most 9"
    assert bind_error(params, 4, ("user_id",)) == "'user_id' given twice"
