"""DeepInfer's API surface, read from the published sdist's source: what the wrapper
(deepinfer_gateway/workers/deepinfer/) and the interface double (tests/deepinfer_double/) stand on.

`python -m tests.deepinfer_surface` (or `make deepinfer-surface`) needs the network; the suite
never runs it. It finds the sdist through PyPI's simple index in its JSON form (PEP 691: the
index is all pip needs, and it gives the file's SHA-256), downloads it, checks the digest and
parses the files below with `ast`. Nothing from the archive is imported or executed: its
setup.py imports torch and wants CUDA (`pip download` stops there), and the package needs
Python 3.12 and an accelerator. The result, tests/data/deepinfer_surface.json, is committed;
tests/unit/test_deepinfer_surface.py checks the wrapper's calls and the double against it
offline. For a new release: `python -m tests.deepinfer_surface --version X.Y.Z` prints what
changed against the committed snapshot and rewrites it.

Per class: public methods with their parameters in order (name, kind, default as source text),
public attributes (properties, annotated class attributes, `self.x` set in `__init__`), enum
members, and the constructor's parameters for the classes the wrapper constructs itself.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import io
import json
import re
import sys
import tarfile
import urllib.request
from pathlib import Path
from typing import Any

SNAPSHOT = Path(__file__).resolve().parent / "data" / "deepinfer_surface.json"
INDEX = "https://pypi.org/simple/{name}/"
DISTRIBUTION = "deepinfer"
VERSION = "0.1.0"

# Class -> (its module, the file defining it in the sdist, whether the wrapper constructs it).
# RequestOutput, Sequence, Scheduler and BlockManager are pybind classes of the compiled
# extension: the sdist documents them in its typed stub, _C/engine.pyi.
CLASSES: dict[str, tuple[str, str, bool]] = {
    "LLMEngine": ("deepinfer.engine.llm_engine", "deepinfer/engine/llm_engine.py", False),
    "EngineArgs": ("deepinfer.engine.arg_utils", "deepinfer/engine/arg_utils.py", True),
    "EngineType": ("deepinfer.engine.engine_type", "deepinfer/engine/engine_type.py", False),
    "SamplingParams": ("deepinfer.sampling_params", "deepinfer/sampling_params.py", True),
    "RequestOutput": ("deepinfer._C.engine", "deepinfer/_C/engine.pyi", False),
    "Sequence": ("deepinfer._C.engine", "deepinfer/_C/engine.pyi", False),
    "Scheduler": ("deepinfer._C.engine", "deepinfer/_C/engine.pyi", False),
    "BlockManager": ("deepinfer._C.engine", "deepinfer/_C/engine.pyi", False),
    "CacheConfig": ("deepinfer.config", "deepinfer/config.py", False),
}
# RequestOutput.get_finish_reason's strings: the C++ function that makes them.
FINISH_REASONS_FILE = "csrc/engine/sequence.hpp"
_FINISH_FUNCTION = re.compile(r"get_finished_reason\(SequenceStatus status\)\s*\{(.*?)\n\}", re.S)

Params = list[list[Any]]  # [name, kind, default source or None]
Surface = dict[str, Any]


# --- reading source -------------------------------------------------------------------------


def _decorators(node: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    return {ast.unparse(d).split("(")[0] for d in node.decorator_list}


def _params(args: ast.arguments, drop_first: bool) -> Params:
    positional = [*args.posonlyargs, *args.args]
    defaults: list[ast.expr | None] = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    out: Params = []
    for i, (arg, default) in enumerate(zip(positional, defaults, strict=True)):
        kind = "positional_only" if i < len(args.posonlyargs) else "positional_or_keyword"
        out.append([arg.arg, kind, None if default is None else ast.unparse(default)])
    if args.vararg:
        out.append([args.vararg.arg, "var_positional", None])
    for arg, kw_default in zip(args.kwonlyargs, args.kw_defaults, strict=True):
        out.append([arg.arg, "keyword_only", None if kw_default is None else ast.unparse(kw_default)])
    if args.kwarg:
        out.append([args.kwarg.arg, "var_keyword", None])
    return out[1:] if drop_first else out


def _self_targets(body: list[ast.stmt]) -> set[str]:
    """Names assigned as `self.<name>` (plain, annotated or tuple assignment) in `body`."""
    names: set[str] = set()
    for node in body:
        for sub in ast.walk(node):
            targets: list[ast.expr] = []
            if isinstance(sub, ast.Assign):
                targets = list(sub.targets)
            elif isinstance(sub, ast.AnnAssign | ast.AugAssign):
                targets = [sub.target]
            for target in targets:
                elements = target.elts if isinstance(target, ast.Tuple) else [target]
                for e in elements:
                    if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "self":
                        names.add(e.attr)
    return names


def class_surface(tree: ast.Module, name: str, with_init: bool) -> Surface:
    """The public surface of class `name` defined at the top of `tree`."""
    node = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name), None)
    if node is None:
        raise LookupError(f"class {name} is not defined in this module")
    is_enum = any(ast.unparse(b) in ("enum.Enum", "Enum", "enum.IntEnum", "IntEnum") for b in node.bases)
    is_dataclass = any(ast.unparse(d).split("(")[0] in ("dataclass", "dataclasses.dataclass")
                       for d in node.decorator_list)
    methods: dict[str, Surface] = {}
    attributes: set[str] = set()
    members: list[str] = []
    fields: Params = []
    init: Params | None = None
    for item in node.body:
        if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
            decorators = _decorators(item)
            if item.name == "__init__":
                attributes |= _self_targets(item.body)
                init = _params(item.args, drop_first=True)
            elif item.name.startswith("_"):
                continue
            elif "property" in decorators:
                attributes.add(item.name)
            elif any(d.endswith(".setter") or d.endswith(".deleter") for d in decorators):
                continue
            else:
                kind = "staticmethod" if "staticmethod" in decorators else (
                    "classmethod" if "classmethod" in decorators else "method")
                methods[item.name] = {"kind": kind, "params": _params(item.args, drop_first=kind != "staticmethod")}
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            field = item.target.id
            if is_dataclass:
                fields.append([field, "positional_or_keyword", None if item.value is None else ast.unparse(item.value)])
            if "ClassVar" not in ast.unparse(item.annotation):
                attributes.add(field)
        elif isinstance(item, ast.Assign) and is_enum:
            members += [t.id for t in item.targets if isinstance(t, ast.Name) and not t.id.startswith("_")]
    surface: Surface = {"methods": dict(sorted(methods.items())),
                        "attributes": sorted(a for a in attributes if not a.startswith("_"))}
    if members:
        surface["members"] = members
    if with_init:
        surface["init"] = fields if is_dataclass else (init or [])
    return surface


def finish_reasons(source: str) -> list[str]:
    """The strings DeepInfer's C++ `get_finished_reason` returns (the empty default excluded)."""
    match = _FINISH_FUNCTION.search(source)
    if match is None:
        raise LookupError(f"get_finished_reason not found in {FINISH_REASONS_FILE}")
    return [r for r in re.findall(r'return\s+"([^"]*)"\s*;', match.group(1)) if r]


def read_surface(files: dict[str, str]) -> dict[str, Surface]:
    """Every class in CLASSES from `files` (sdist-relative path -> source text)."""
    trees: dict[str, ast.Module] = {}
    out: dict[str, Surface] = {}
    for name, (module, path, with_init) in CLASSES.items():
        tree = trees.get(path) or trees.setdefault(path, ast.parse(files[path], filename=path))
        out[name] = {"module": module, "source": path, **class_surface(tree, name, with_init)}
    return out


# --- comparing ------------------------------------------------------------------------------


def extras(
    base: dict[str, Surface], other: dict[str, Surface], allowed: dict[str, set[str]] | None = None
) -> list[str]:
    """What `other` offers that `base` lacks or spells differently, one line each: classes,
    methods (kind, parameter names, order, kinds, defaults), attributes, enum members and
    constructor parameters. Names in `allowed[class]` are skipped."""
    allowed = allowed or {}
    lines: list[str] = []
    for cls, surface in other.items():
        real = base.get(cls)
        if real is None:
            lines.append(f"class {cls}")
            continue
        skip = allowed.get(cls, set())
        for name, method in surface["methods"].items():
            if name in skip:
                continue
            theirs = real["methods"].get(name)
            if theirs is None:
                lines.append(f"{cls}.{name}()")
            elif theirs != method:
                lines.append(f"{cls}.{name}: {_signature(method)} where the other has {_signature(theirs)}")
        lines += [f"{cls}.{a}" for a in surface["attributes"] if a not in skip and a not in real["attributes"]]
        lines += [f"{cls}.{m} (member)" for m in surface.get("members", []) if m not in real.get("members", [])]
        if "init" in surface:
            init = real.get("init")
            if init is None:
                lines.append(f"{cls}(...) constructor")
            else:
                known = {p[0]: p for p in init}
                for position, param in enumerate(surface["init"]):
                    if param[0] not in known:
                        lines.append(f"{cls}({param[0]}=...)")
                    elif known[param[0]][1:] != param[1:] or init.index(known[param[0]]) != position:
                        lines.append(f"{cls}({_param(param)}) at {position} where the other has "
                                     f"{_param(known[param[0]])} at {init.index(known[param[0]])}")
    return lines


def diff(old: dict[str, Surface], new: dict[str, Surface]) -> list[str]:
    return [f"- {line}" for line in extras(new, old)] + [f"+ {line}" for line in extras(old, new)]


def _param(p: list[Any]) -> str:
    prefix = {"var_positional": "*", "var_keyword": "**"}.get(p[1], "")
    suffix = "" if p[2] is None else f"={p[2]}"
    marker = {"positional_only": " /", "keyword_only": " (keyword)"}.get(p[1], "")
    return f"{prefix}{p[0]}{suffix}{marker}"


def _signature(method: Surface) -> str:
    return f"{method['kind']}({', '.join(_param(p) for p in method['params'])})"


# --- fetching -------------------------------------------------------------------------------


def _get(url: str, accept: str | None = None) -> bytes:
    request = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
    with urllib.request.urlopen(request, timeout=60) as response:
        data: bytes = response.read()
        return data


def find_sdist(name: str, version: str) -> dict[str, Any]:
    """The sdist's entry in PyPI's simple index (PEP 691 JSON): filename, url, hashes."""
    index = json.loads(_get(INDEX.format(name=name), "application/vnd.pypi.simple.v1+json"))
    filename = f"{name}-{version}.tar.gz"
    for entry in index["files"]:
        if entry["filename"] == filename:
            return dict(entry)
    raise LookupError(f"{filename} is not in {INDEX.format(name=name)}")


def fetch(name: str, version: str) -> tuple[dict[str, Any], dict[str, str]]:
    """(what the snapshot says about the archive, its sources read) for `name==version`."""
    entry = find_sdist(name, version)
    data = _get(entry["url"])
    sha256 = hashlib.sha256(data).hexdigest()
    if sha256 != entry["hashes"]["sha256"]:
        raise ValueError(f"{entry['filename']}: SHA-256 {sha256} is not the index's {entry['hashes']['sha256']}")
    wanted = {path for _, path, _ in CLASSES.values()} | {FINISH_REASONS_FILE}
    files: dict[str, str] = {}
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as archive:
        for member in archive.getmembers():
            path = member.name.split("/", 1)[-1]  # drop the "name-version/" top folder
            if path in wanted and member.isfile():
                extracted = archive.extractfile(member)
                assert extracted is not None
                files[path] = extracted.read().decode()
    missing = wanted - files.keys()
    if missing:
        raise LookupError(f"{entry['filename']} lacks {sorted(missing)}")
    sdist = {"filename": entry["filename"], "url": entry["url"], "sha256": sha256, "size": len(data)}
    return sdist, files


def build(name: str, version: str) -> dict[str, Any]:
    sdist, files = fetch(name, version)
    return {
        "distribution": name,
        "version": version,
        "sdist": sdist,
        "read_with": "tests/deepinfer_surface.py (ast; nothing imported or run)",
        "classes": read_surface(files),
        "finish_reasons": finish_reasons(files[FINISH_REASONS_FILE]),
    }


def dumps(snapshot: dict[str, Any]) -> str:
    """Indented JSON with each innermost list on one line (a parameter, an attribute list)."""
    text = json.dumps(snapshot, indent=1)
    return re.sub(r"\[[^\[\]{}]*\]", lambda m: json.dumps(json.loads(m.group(0))), text) + "\n"


def load(path: Path = SNAPSHOT) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", default=VERSION)
    parser.add_argument("--out", type=Path, default=SNAPSHOT)
    args = parser.parse_args(argv)
    new = build(DISTRIBUTION, args.version)
    if args.out.exists():
        old = load(args.out)
        changes = diff(old["classes"], new["classes"])
        old_reasons, new_reasons = set(old["finish_reasons"]), set(new["finish_reasons"])
        changes += [f"- finish reason {r!r}" for r in sorted(old_reasons - new_reasons)]
        changes += [f"+ finish reason {r!r}" for r in sorted(new_reasons - old_reasons)]
        print(f"{old['version']} -> {new['version']}: " + ("\n  ".join(["", *changes]) if changes else "no change"))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(dumps(new))
    print(f"{args.out}: {new['sdist']['filename']} sha256 {new['sdist']['sha256']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
