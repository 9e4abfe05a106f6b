"""What e2e tests write to start a gateway of their own: `[[api_keys]]` tables, and a gateway in
front of one sim worker of its own (the session's shared `sim_gateway` cannot take extra TOML)."""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

from harness.launch import Gateway, SimCluster


def api_key(name: str, key: str | None = None, **fields: object) -> str:
    """One `[[api_keys]]` table: the key (`name` itself unless given) stored as its sha256, then
    `fields` as TOML values (str, int, bool and lists of them, which JSON writes as TOML does)."""
    digest = hashlib.sha256((name if key is None else key).encode()).hexdigest()
    lines = ["[[api_keys]]", f'name = "{name}"', f'key_sha256 = "{digest}"']
    lines += [f"{field} = {json.dumps(value)}" for field, value in fields.items()]
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def one_worker_gateway(tmp: Path, extra_toml: str = "", time_scale: float = 20.0,
                       worker_args: list[str] | None = None) -> Iterator[Gateway]:
    """A gateway with `extra_toml` in its config, in front of one unified sm100 sim worker (started
    with `worker_args`); ready when entered, both stopped on exit."""
    cluster = SimCluster("unified:sm100", time_scale=time_scale, extra=worker_args)
    try:
        gw = Gateway(tmp, [(cluster.urls[0], "unified", "sm100")], extra_toml=extra_toml)
        try:
            gw.wait_ready(1)
            yield gw
        finally:
            gw.stop()
    finally:
        cluster.stop()
