"""Settings that moved into a section, still read under their old flat names.

The `redis_*` keys became the `[redis]` section: `redis_url = ...` is now `[redis] url =
...` (`DGW_REDIS_URL` is `DGW_REDIS__URL`). `load_settings` moves an old key into its section
within the source that gave it, before the sources merge, so each source keeps its rank (an
old `DGW_REDIS_URL` still overrides the file's `[redis] url`), and logs one warning naming
each old key found and its new name. One source giving a setting under both names is an
error: which one it meant cannot be told.
"""

from __future__ import annotations

from typing import Any

# old top-level key -> (section, key in it)
RENAMED: dict[str, tuple[str, str]] = {
    "redis_url": ("redis", "url"),
    "redis_cluster": ("redis", "cluster"),
    "redis_password": ("redis", "password"),
    "redis_password_file": ("redis", "password_file"),
    "redis_timeout_s": ("redis", "timeout_s"),
}


class GivenTwice(ValueError):
    """A source gives one setting under its old and its new name."""

    def __init__(self, old: str, new: str):
        self.old, self.new = old, new
        super().__init__(f"{new}: also given as {old}, its old name; keep {new}")


def new_name(old: str) -> str:
    """`redis_url` -> `redis.url`."""
    return ".".join(RENAMED[old])


def into_sections(values: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """One source's values with each old key moved into its section, and the old keys found
    (in RENAMED's order). GivenTwice where the section has that key too."""
    found = [old for old in RENAMED if old in values]
    if not found:
        return values, []
    out = dict(values)
    for old in found:
        value = out.pop(old)
        section, key = RENAMED[old]
        table = out.get(section)
        table = dict(table) if isinstance(table, dict) else {}  # a non-table is left for validation to refuse
        if key in table:
            raise GivenTwice(old, new_name(old))
        if isinstance(out.get(section, {}), dict):
            out[section] = {**table, key: value}
    return out, found
