"""No import cycle anywhere in the package: every `deepinfer_gateway` import of every module
(function-level and TYPE_CHECKING ones included) parsed, the module graph searched for a cycle."""

from __future__ import annotations

import ast
from pathlib import Path

import deepinfer_gateway

PACKAGE = Path(deepinfer_gateway.__file__).resolve().parent
ROOT = "deepinfer_gateway"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports (`from pkg import mod` names the module when one exists)."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names if alias.name.startswith(ROOT))
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative
                    anchor = name.split(".") if is_package else name.split(".")[:-1]
                    anchor = anchor[:len(anchor) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                if not base.startswith(ROOT):
                    continue
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.add(sub if sub in modules else base)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph (its modules in order, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_cycle_finder_finds_one() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_graph_sees_function_level_imports() -> None:
    graph = import_graph()
    # gateway_process imports the app in a function
    assert "deepinfer_gateway.gateway.app" in graph["deepinfer_gateway.process.gateway_process"]
    assert len(graph) > 100


def test_no_import_cycle_in_the_package() -> None:
    assert find_cycle(import_graph()) is None
