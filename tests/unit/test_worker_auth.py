"""The worker token: token files (several tokens, rotation, a bad update), the check, the
401 before the app, the loopback rule."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import httpx
import pytest

from deepinfer_gateway.core.worker_auth import (
    RequireWorkerToken,
    SecretTokens,
    TokenError,
    bearer,
    check_bind,
    is_loopback,
    parse_tokens,
    tokens_from,
    worker_tokens_from_env,
)


def test_parse_tokens_skips_blank_lines_and_comments() -> None:
    assert parse_tokens("# rotated 2026-12\n\n  new-token  \nold-token\n") == ("new-token", "old-token")


def _write(path: Path, text: str, bump_ns: int) -> None:
    path.write_text(text)
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + bump_ns))  # a distinct mtime on coarse clocks


def test_file_tokens_follow_a_rotation(tmp_path: Path) -> None:
    path = tmp_path / "worker-token"
    _write(path, "old\n", 0)
    tokens = SecretTokens(path=path, recheck_s=0.0)
    assert tokens.current() == "old" and tokens.accepts(b"old") and not tokens.accepts(b"new")
    _write(path, "old\nnew\n", 1_000_000)  # step 1: workers accept both
    assert tokens.accepts(b"old") and tokens.accepts(b"new") and tokens.current() == "old"
    _write(path, "new\nold\n", 2_000_000)  # step 2: callers send the new one
    assert tokens.current() == "new"
    _write(path, "new\n", 3_000_000)  # step 3: the old one is gone
    assert not tokens.accepts(b"old") and tokens.accepts(b"new")


def test_a_broken_update_keeps_the_last_tokens(tmp_path: Path) -> None:
    path = tmp_path / "worker-token"
    _write(path, "tok\n", 0)
    tokens = SecretTokens(path=path, recheck_s=0.0)
    _write(path, "\n# nothing\n", 1_000_000)
    assert tokens.accepts(b"tok")
    path.unlink()
    assert tokens.current() == "tok"


def test_missing_or_empty_sources_are_errors(tmp_path: Path) -> None:
    with pytest.raises(TokenError, match="cannot read"):
        SecretTokens(path=tmp_path / "absent")
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(TokenError, match="holds no token"):
        SecretTokens(path=tmp_path / "empty")
    assert tokens_from(None, None) is None and bearer(None) == {}


def test_environment_names(tmp_path: Path) -> None:
    (tmp_path / "t").write_text("from-file\n")
    from_file = worker_tokens_from_env({"DGW_WORKER_TOKEN_FILE": str(tmp_path / "t")})
    assert from_file is not None and bearer(from_file) == {"Authorization": "Bearer from-file"}
    from_value = worker_tokens_from_env({"DGW_WORKER_TOKEN": "literal"})
    assert from_value is not None and from_value.current() == "literal"
    assert worker_tokens_from_env({}) is None


def test_a_tokenless_worker_stays_on_loopback() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("worker-0.workers")
    check_bind("127.0.0.1", None)
    check_bind("0.0.0.0", SecretTokens(value="t"))
    with pytest.raises(SystemExit, match="DGW_WORKER_TOKEN"):
        check_bind("0.0.0.0", None)


async def _reached(scope: Any, receive: Any, send: Any) -> None:
    _reached.calls += 1  # type: ignore[attr-defined]
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"engine"})


def test_middleware_refuses_before_the_app() -> None:
    _reached.calls = 0  # type: ignore[attr-defined]
    app = RequireWorkerToken(_reached, SecretTokens(value="new\nold"))

    async def calls() -> list[int]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://worker") as client:
            statuses = []
            for path, headers in [("/v1/worker/generate", {}),
                                  ("/v1/worker/generate", {"authorization": "Bearer wrong"}),
                                  ("/v1/chat/completions", {"authorization": "Basic new"}),
                                  ("/v1/worker/generate", {"authorization": "Bearer old"}),
                                  ("/v1/worker/info", {"authorization": "bearer new"}),
                                  ("/health", {})]:
                response = await client.post(path, headers=headers)
                statuses.append(response.status_code)
                if response.status_code == 401:
                    assert response.json()["error"]["kind"] == "unauthorized"
            return statuses

    assert asyncio.run(calls()) == [401, 401, 401, 200, 200, 200]
    assert _reached.calls == 3  # type: ignore[attr-defined]
