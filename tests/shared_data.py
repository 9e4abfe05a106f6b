"""The shared data (public traces) that CI lays beside the clone, at `../shared`: found relative
to this repository, never at one machine's path. Only tests read it; the project never does.

A test that needs a file is marked `@needs_shared(path, ...)`; tests/conftest.py checks the mark
before the test's fixtures start. Missing data skips the test, except under CI=true, where the
data is always laid out and a skip would hide that it is not: there the test fails."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

SHARED = Path(__file__).resolve().parents[2] / "shared"  # tests/ -> the clone -> beside it
TRACES = SHARED / "traces"
CONVERSATION = TRACES / "mooncake_conversation_trace.first_half.jsonl.gz"
TRACELAB = TRACES / "tracelab"

MARK = "shared_data"


def needs_shared(*paths: Path) -> pytest.MarkDecorator:
    """Mark a test that reads these shared files or folders."""
    return getattr(pytest.mark, MARK)(*paths)


def require(path: Path) -> Path:
    """`path` when it exists; else skip the test, or fail it under CI=true."""
    if not path.exists():
        why = f"shared data missing: {path} (CI lays shared/ beside the clone)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{why}; under CI=true missing shared data fails", pytrace=False)
        pytest.skip(why)
    return path


def require_marked(item: pytest.Item) -> None:
    """Require every path of the test's `needs_shared` marks."""
    for mark in item.iter_markers(MARK):
        for path in mark.args:
            require(path)
