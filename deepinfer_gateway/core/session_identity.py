"""A request's routing session, and its parent session for a subagent, from the headers agent
clients send as they are (a leaf: imports nothing of the gateway).

`HEADER_SOURCES` is read in order; the first source whose session header is present names the
session (and, when the source has them, the subagent and its parent). Without any, the body's
session (`user`, `prompt_cache_key`, `metadata.user_id`: recipe_bridge/fields.py) names it.
docs/api.md "Sessions" lists the same table with where each name was verified.

Sessions are keyed per API key (`scoped`): a digest of the key's scope and the client's value,
so one tenant's session names never steer another's requests and no client-chosen string is
stored in Redis.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class HeaderSource:
    client: str
    session: str  # the session (the root agent's, for a client that names subagents apart)
    agent: str | None = None  # a subagent's own id, sent beside the root's session (Claude Code)
    parent: str | None = None  # the parent's id: an agent id (with `agent`), else a session


HEADER_SOURCES: tuple[HeaderSource, ...] = (
    HeaderSource("Dynamo", "x-dynamo-session-id", parent="x-dynamo-parent-session-id"),
    HeaderSource("Claude Code", "x-claude-code-session-id", agent="x-claude-code-agent-id",
                 parent="x-claude-code-parent-agent-id"),
    HeaderSource("Codex", "thread-id", parent="x-codex-parent-thread-id"),
    HeaderSource("Codex (without thread-id)", "session-id"),
    HeaderSource("OpenCode, vllm-router", "x-session-id", parent="x-parent-session-id"),
    HeaderSource("OpenCode (its own providers)", "x-opencode-session", parent="x-parent-session-id"),
    HeaderSource("Codex (before thread-id)", "session_id"),
    HeaderSource("AIPerf, Dynamo's benchmarks, vllm-router", "x-correlation-id"),
)


@dataclass(frozen=True)
class SessionIdentity:
    session: str | None = None
    parent: str | None = None  # the parent session, for a subagent's requests


def _value(headers: Mapping[str, str], name: str | None) -> str | None:
    if name is None:
        return None
    # Any length: the value is only ever hashed (`scoped`), and the request head's bound
    # (http_bounds.py, max_header_bytes) bounds it.
    return headers.get(name) or None


def identity_from(headers: Mapping[str, str], body_session: str | None = None) -> SessionIdentity:
    """The session (and parent) the first present `HEADER_SOURCES` entry names, else `body_session`.
    `headers`: lower-case names (Starlette's and Envoy's header maps are)."""
    for source in HEADER_SOURCES:
        session = _value(headers, source.session)
        if session is None:
            continue
        if source.agent is not None:
            # Claude Code sends the root's session id on every request; a subagent adds its agent id
            # and, when its parent is itself a subagent, that parent's agent id.
            agent = _value(headers, source.agent)
            if agent is None:
                return SessionIdentity(session)
            parent_agent = _value(headers, source.parent)
            return SessionIdentity(f"{session}/{agent}", f"{session}/{parent_agent}" if parent_agent else session)
        return SessionIdentity(session, _value(headers, source.parent))
    return SessionIdentity(body_session)


def _digest(scope: str, value: str) -> str:
    return hashlib.blake2b(f"{scope}\0{value}".encode(), digest_size=16).hexdigest()


def scoped(identity: SessionIdentity, scope: str) -> SessionIdentity:
    """`identity` keyed within an API key's `scope`."""
    return SessionIdentity(
        _digest(scope, identity.session) if identity.session is not None else None,
        _digest(scope, identity.parent) if identity.parent is not None else None)
