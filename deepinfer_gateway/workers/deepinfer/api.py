"""The DeepInfer names this wrapper uses, imported lazily.

`deepinfer` needs Python 3.12, torch and an accelerator toolchain, so nothing in the
gateway may import it at module load. `load_api()` imports exactly the names below (the
module paths are those of the deepinfer 0.1.0 sdist) when an engine is constructed, and
turns a missing install into one actionable error. Tests pass `root=` a module that
mirrors the same layout (the interface double) instead.
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass
from types import ModuleType
from typing import Any

INSTALL_HINT = (
    "the 'deepinfer' engine needs DeepInfer installed in this worker's environment: "
    "Python 3.12, GCC >= 13, torch 2.13 and CUDA 13 (NVIDIA SM100) or CANN 9.2 (Ascend 950), "
    "then `DEEPINFER_ACCELERATOR=nvidia|ascend pip install deepinfer==0.1.0` (the source "
    "distribution builds its extensions for that accelerator). See docs/deepinfer.md. "
    "Use `--engine sim` to run without DeepInfer."
)


class DeepInferNotInstalled(RuntimeError):
    """`--engine deepinfer` was chosen where `deepinfer` cannot be imported."""


@dataclass(frozen=True, slots=True)
class DeepInferApi:
    LLMEngine: type[Any]  # deepinfer.engine.llm_engine.LLMEngine
    EngineArgs: type[Any]  # deepinfer.engine.arg_utils.EngineArgs
    EngineType: Any  # deepinfer.engine.engine_type.EngineType (an Enum)
    SamplingParams: type[Any]  # deepinfer.sampling_params.SamplingParams
    RequestOutput: Any  # deepinfer._C.engine.RequestOutput (static accessors on handles)
    np: ModuleType  # numpy: prompts are np.ndarray[int32]; imported with deepinfer


_PATHS = {
    "LLMEngine": ("engine.llm_engine", "LLMEngine"),
    "EngineArgs": ("engine.arg_utils", "EngineArgs"),
    "EngineType": ("engine.engine_type", "EngineType"),
    "SamplingParams": ("sampling_params", "SamplingParams"),
    "RequestOutput": ("_C.engine", "RequestOutput"),
}


def load_api(root: str = "deepinfer") -> DeepInferApi:
    """Import DeepInfer's serving names from package `root` (the double uses another root)."""
    names: dict[str, Any] = {}
    try:
        for attr, (module, name) in _PATHS.items():
            names[attr] = getattr(importlib.import_module(f"{root}.{module}"), name)
        np = importlib.import_module("numpy")
    except ImportError as exc:
        where = f"Python {sys.version_info.major}.{sys.version_info.minor}"
        raise DeepInferNotInstalled(f"cannot import {exc.name or root!r} ({where}): {INSTALL_HINT}") from exc
    return DeepInferApi(np=np, **names)
