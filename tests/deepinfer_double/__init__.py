"""A fake `deepinfer` package for tests: same module layout as deepinfer 0.1.0, so the
wrapper loads it with `load_api("tests.deepinfer_double")`, or as `deepinfer` itself through
`install_as_deepinfer(monkeypatch)`. See core.py for what it mirrors and its knobs."""

from __future__ import annotations

import sys
from typing import Any

from .core import DoubleKvTransfer

__all__ = ["DoubleKvTransfer", "install_as_deepinfer", "install_in_process"]

_SUBMODULES = [
    "engine",
    "engine.llm_engine",
    "engine.arg_utils",
    "engine.engine_type",
    "sampling_params",
    "_C",
    "_C.engine",
]


def install_as_deepinfer(monkeypatch: Any) -> None:
    """Make `import deepinfer...` resolve to the double for one test (undone after it)."""
    _install(monkeypatch.setitem)


def install_in_process() -> None:
    """Make `import deepinfer...` resolve to the double for the rest of this process
    (the double's worker launcher, serve.py; never in the test process itself)."""
    _install(lambda mapping, key, value: mapping.__setitem__(key, value))


def _install(setitem: Any) -> None:
    import importlib

    setitem(sys.modules, "deepinfer", sys.modules[__name__])
    for name in _SUBMODULES:
        setitem(sys.modules, f"deepinfer.{name}", importlib.import_module(f"{__name__}.{name}"))
