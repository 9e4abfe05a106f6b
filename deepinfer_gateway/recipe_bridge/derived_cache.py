"""A per-user disk cache for data derived from a tokenizer.json, to shorten process start-up.

Every gateway and sim worker derives the same tables from the same ~6 MB tokenizer.json
when it starts: the tiktoken ranks and their self-check (~0.5 s), the detokenizer's byte
table (~0.3 s), the demo vocabulary's `<｜System｜>` stand-in (~0.2 s), and the vocabulary
size and added tokens (a JSON parse each, ~0.06 s). Loading them from here takes
milliseconds.

An entry's key is a SHA-256 over everything the value depends on: the source text, the
source file of the module that derives it (any code change invalidates its entries), the
Python version and the versions of the libraries involved. Values are plain data written
with `marshal` (loading runs no code). The cache is only a shortcut: a missing, unreadable
or unwritable entry means building the value from scratch.

Location: $DGW_CACHE_DIR, else $XDG_CACHE_HOME/deepinfer-gateway, else
~/.cache/deepinfer-gateway. Each kind keeps its `KEEP_PER_KIND` newest entries.
"""

from __future__ import annotations

import hashlib
import marshal
import os
import sys
import tempfile
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import Any, TypeVar, cast

T = TypeVar("T")

KEEP_PER_KIND = 4
_SUFFIX = ".marshal"


def cache_dir() -> Path:
    configured = os.environ.get("DGW_CACHE_DIR")
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "deepinfer-gateway"


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@lru_cache(maxsize=4)
def text_digest(text: str) -> str:
    """SHA-256 of a loaded tokenizer.json, computed once: several entries are keyed by it
    (the cache holds the text, which its `TokenizerBundle` holds anyway)."""
    return digest(text.encode("utf-8", "surrogatepass"))


@lru_cache(maxsize=16)
def _source_digest(module_file: str) -> str:
    return digest(Path(module_file).read_bytes())


def entry_key(source_digest: str, module_file: str, *versions: str) -> str:
    """The key of a value derived from a source (by its digest) by the code in `module_file`."""
    parts = (source_digest, _source_digest(module_file), sys.version.split()[0], *versions)
    return digest("\0".join(parts).encode())


def _path(kind: str, key: str) -> Path:
    return cache_dir() / f"{kind}-{key}{_SUFFIX}"


def load(kind: str, key: str) -> Any | None:
    """The stored value, or None (absent or unreadable)."""
    try:
        return marshal.loads(_path(kind, key).read_bytes())
    except (OSError, EOFError, ValueError, TypeError, RuntimeError):  # RuntimeError: no home directory
        return None


def store(kind: str, key: str, value: Any) -> None:
    """Write atomically (concurrent starts may race: the last rename wins, all equal); errors ignored."""
    try:
        path = _path(kind, key)
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{kind}-", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                marshal.dump(value, f)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
        _prune(path.parent, kind)
    except (OSError, ValueError, RuntimeError):  # a value marshal cannot write; no home directory
        pass


def _prune(directory: Path, kind: str) -> None:
    """Drop all but the newest entries of `kind` (old code versions, old tokenizer files)."""
    entries = sorted(directory.glob(f"{kind}-*{_SUFFIX}"), key=_mtime, reverse=True)
    for old in entries[KEEP_PER_KIND:]:
        old.unlink(missing_ok=True)


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def cached(kind: str, key: str, build: Callable[[], T], valid: Callable[[Any], bool]) -> T:
    """The stored value if it passes `valid`, else `build()` (stored for next time)."""
    value = load(kind, key)
    if value is not None and valid(value):
        return cast(T, value)  # `valid` vouched for it
    value = build()
    store(kind, key, value)
    return value
