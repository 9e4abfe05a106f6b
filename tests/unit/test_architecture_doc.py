"""docs/architecture.md names every module of the package in its tables."""

from __future__ import annotations

from pathlib import Path

import deepinfer_gateway

PACKAGE = Path(deepinfer_gateway.__file__).parent
DOC = PACKAGE.parent / "docs" / "architecture.md"


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
