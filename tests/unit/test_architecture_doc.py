"""docs/architecture.md names every module of the package in its tables; no docs table says the
same thing twice; and the docs and the package's docstrings and comments name only files and
modules that exist (a module moved or renamed leaves no stale mention behind)."""

from __future__ import annotations

import ast
import importlib.util
import io
import os
import re
import tokenize
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import deepinfer_gateway

PACKAGE = Path(deepinfer_gateway.__file__).parent
REPO = PACKAGE.parent
DOC = REPO / "docs" / "architecture.md"
DOCS = [*sorted((REPO / "docs").glob("*.md")), REPO / "README.md"]


def table_rows() -> str:
    return "\n".join(line for line in DOC.read_text().splitlines() if line.startswith("|"))


def test_every_module_is_in_the_architecture_tables() -> None:
    rows = table_rows()
    modules = [p for p in sorted(PACKAGE.rglob("*.py")) if p.name != "__init__.py"]
    assert len(modules) > 100
    # A folder's row names its modules by file name; the tables of other modules by path.
    missing = [str(p.relative_to(PACKAGE)) for p in modules
               if f"`{p.relative_to(PACKAGE)}`" not in rows and p.name not in rows]
    assert missing == [], f"add these to docs/architecture.md's module tables: {missing}"


def test_every_path_in_the_tables_exists() -> None:
    cells = [line.split("|")[1].strip() for line in table_rows().splitlines()]
    named = [c.strip("`") for c in cells if c.startswith("`") and c.endswith(".py`") and "/" in c]
    assert named and [n for n in named if not (PACKAGE / n).exists()] == []


def test_each_module_has_one_row_in_the_architecture_tables() -> None:
    firsts = [line.split("|")[1].strip() for line in table_rows().splitlines()]
    assert sorted({c for c in firsts if c.endswith(".py`") and firsts.count(c) > 1}) == []


# --- no docs table says the same thing twice ---

def tables(text: str) -> Iterator[list[tuple[int, list[str]]]]:
    """Each markdown table as (line number, cells) per row, its separator row left out."""
    rows: list[tuple[int, list[str]]] = []
    for n, line in enumerate([*text.splitlines(), ""], 1):
        if line.strip().startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if not set("".join(cells)) <= set("-: "):
                rows.append((n, cells))
        elif rows:
            yield rows
            rows = []


def repeated_rows(text: str) -> list[tuple[int, int]]:
    """(first line, repeating line) of rows whose text past the first cell is another row's."""
    out = []
    for rows in tables(text):
        seen: dict[tuple[str, ...], int] = {}
        for n, cells in rows:
            said = tuple(cells[1:])
            if said in seen and any(said):
                out.append((seen[said], n))
            seen.setdefault(said, n)
    return out


def test_no_two_rows_of_a_docs_table_say_the_same() -> None:
    repeats = [f"{doc.relative_to(REPO)}:{first} and :{n}"
               for doc in DOCS for first, n in repeated_rows(doc.read_text())]
    assert repeats == [], f"rows with the same text (one of each pair copied over the other?): {repeats}"


# --- the docs, docstrings and comments name only files and modules that exist ---

# A relative file name, bare or with folders (`relay.py`, `gateway/serving/relay.py`); not
# part of a URL or an absolute path, not a placeholder (`gateway/upstream/<engine>.py`).
FILE_NAME = re.compile(r"(?<![\w/.<>{}~-])((?:[A-Za-z_][\w-]*/)*[A-Za-z_]\w*\.py)\b")
PACKAGE_NAME = re.compile(r"(?<![\w.])deepinfer_gateway(?:\.\w+)+")
# `module.Name`: a class or constant through its module (`protocol.WorkerInfo`, `upstream_http.HttpPool`).
MODULE_ATTRIBUTE = re.compile(r"(?<![\w./])([a-z_][a-z0-9_]*)\.([A-Z]\w*)")
# Files of other projects that the docs cite, by the name they have there.
OTHER_PROJECTS = {
    "setup.py", "environ.py",  # the deepinfer sdist (docs/deepinfer.md)
    "vllm/distributed/kv_events.py", "examples/online_serving/kv_events_subscriber.py",  # vLLM (docs/kv-index.md)
}
# Modules of other projects whose names a package folder shares: `deepinfer.SamplingParams` is the engine's.
OTHER_MODULES = {"deepinfer"}
SKIPPED_FOLDERS = {".git", ".venv", "__pycache__", "node_modules", ".mypy_cache", ".ruff_cache", ".pytest_cache"}


@cache
def repository_files() -> tuple[str, ...]:
    """Every file's path relative to the repository (the working tree, so a new file counts)."""
    out = []
    for root, folders, files in os.walk(REPO):
        folders[:] = [f for f in folders if f not in SKIPPED_FOLDERS and not f.endswith(".egg-info")]
        out += [os.path.relpath(os.path.join(root, f), REPO) for f in files]
    return tuple(out)


@cache
def package_modules() -> dict[str, list[Path]]:
    """Module and folder names of the package -> their paths (a name may be used in several folders)."""
    out: dict[str, list[Path]] = {}
    for path in PACKAGE.rglob("*.py"):
        name = path.stem if path.name != "__init__.py" else path.parent.name
        out.setdefault(name, []).append(path)
    return out


@cache
def logger_names() -> frozenset[str]:
    """`deepinfer_gateway.access` and the like: loggers, not modules."""
    return frozenset(name for path in PACKAGE.rglob("*.py")
                     for name in re.findall(r"getLogger\(\s*\"([\w.]+)\"", path.read_text()))


def _defines(paths: list[Path], name: str) -> bool:
    return any(re.search(rf"\b{re.escape(name)}\b", p.read_text()) for p in paths)


def _file_exists(name: str) -> bool:
    return name in OTHER_PROJECTS or any(f == name or f.endswith("/" + name) for f in repository_files())


def _package_name_exists(dotted: str) -> bool:
    """`deepinfer_gateway.a.b[.attribute]`: the longest module prefix exists and defines the rest's first name."""
    if dotted in logger_names():
        return True
    parts = dotted.split(".")[1:]
    for i in range(len(parts), -1, -1):
        base = PACKAGE.joinpath(*parts[:i])
        module = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
        if module.is_file():
            return i == len(parts) or _defines([module], parts[i])
    return False


def _module_attribute_exists(module: str, attribute: str) -> bool:
    """`module.Name`: a package module (or folder's `__init__.py`) that mentions Name, or a module
    from outside the package."""
    paths = package_modules().get(module)
    if paths is not None and module not in OTHER_MODULES:
        return _defines(paths, attribute)
    try:
        return module in OTHER_MODULES or importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def stale_names(text: str) -> list[str]:
    """The file and module names in `text` that do not exist (any more)."""
    files = [m.group(1) for m in FILE_NAME.finditer(text) if not _file_exists(m.group(1))]
    dotted = [m.group(0) for m in PACKAGE_NAME.finditer(text) if not _package_name_exists(m.group(0))]
    attributes = [m.group(0) for m in MODULE_ATTRIBUTE.finditer(text)
                  if m.group(1) != "deepinfer_gateway" and not _module_attribute_exists(m.group(1), m.group(2))]
    return files + dotted + attributes


def docstrings_and_comments(path: Path) -> Iterator[tuple[int, str]]:
    source = path.read_text()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                yield getattr(node, "lineno", 1), doc
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string


def test_the_stale_name_check_finds_what_it_is_for() -> None:
    assert stale_names("`gateway/serving/relay.py`, relay.py, `deepinfer_gateway.gateway.serving.relay.Relay`,"
                       " protocol.WorkerInfo, asyncio.Queue, logger deepinfer_gateway.access, docs/metrics.md") == []
    assert stale_names("serving.py, `gateway/relay.py`, (upstream_http.py), deepinfer_gateway.gateway.metrics,"
                       " deepinfer_gateway.core.protocol.NoSuchThing, upstream_http.HttpPool,"
                       " protocol.NoSuchThing") == [
        "serving.py", "gateway/relay.py", "upstream_http.py", "deepinfer_gateway.gateway.metrics",
        "deepinfer_gateway.core.protocol.NoSuchThing", "upstream_http.HttpPool", "protocol.NoSuchThing"]


def test_the_docs_name_only_files_and_modules_that_exist() -> None:
    stale = [f"{doc.relative_to(REPO)}:{n}: {name}" for doc in DOCS
             for n, line in enumerate(doc.read_text().splitlines(), 1) for name in stale_names(line)]
    assert stale == [], "names of files or modules that do not exist:\n" + "\n".join(stale)


def test_the_package_docstrings_and_comments_name_only_files_and_modules_that_exist() -> None:
    stale = [f"{path.relative_to(REPO)}:{n}: {name}" for path in sorted(PACKAGE.rglob("*.py"))
             for n, text in docstrings_and_comments(path) for name in stale_names(text)]
    assert stale == [], "names of files or modules that do not exist:\n" + "\n".join(stale)
