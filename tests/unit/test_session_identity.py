"""The session and parent each agent client's headers name (session_identity.py), in order."""

from __future__ import annotations

import pytest

from deepinfer_gateway.core.session_identity import SessionIdentity, identity_from, scoped


@pytest.mark.parametrize(("headers", "expected"), [
    ({"x-dynamo-session-id": "run:planner", "x-dynamo-parent-session-id": "run"},
     SessionIdentity("run:planner", "run")),
    ({"x-claude-code-session-id": "S"}, SessionIdentity("S")),
    ({"x-claude-code-session-id": "S", "x-claude-code-agent-id": "A"}, SessionIdentity("S/A", "S")),
    ({"x-claude-code-session-id": "S", "x-claude-code-agent-id": "B", "x-claude-code-parent-agent-id": "A"},
     SessionIdentity("S/B", "S/A")),
    ({"session-id": "root", "thread-id": "child", "x-codex-parent-thread-id": "root"},
     SessionIdentity("child", "root")),
    ({"session-id": "root"}, SessionIdentity("root")),
    ({"session_id": "conv"}, SessionIdentity("conv")),
    ({"x-session-id": "ses_2", "x-session-affinity": "ses_2", "x-parent-session-id": "ses_1"},
     SessionIdentity("ses_2", "ses_1")),
    ({"x-opencode-session": "ses_3"}, SessionIdentity("ses_3")),
    ({"x-correlation-id": "c"}, SessionIdentity("c")),
    ({"x-dynamo-session-id": "d", "x-session-id": "o"}, SessionIdentity("d")),  # Dynamo's own first
    ({"x-session-id": "o", "x-correlation-id": "c"}, SessionIdentity("o")),
])
def test_each_clients_headers(headers: dict[str, str], expected: SessionIdentity) -> None:
    assert identity_from(headers, "body-user") == expected


def test_the_body_names_it_without_headers_and_a_long_value_is_a_session_too() -> None:
    assert identity_from({}, "alice") == SessionIdentity("alice")
    assert identity_from({"x-session-id": ""}, "alice") == SessionIdentity("alice")  # empty: not sent
    long = "x" * 4096  # honoured, never dropped: it is only hashed, and the head's bound bounds it
    assert identity_from({"x-session-id": long}, None) == SessionIdentity(long)
    assert len(scoped(SessionIdentity(long), "key").session or "") == 32


def test_scoped_sessions_differ_per_api_key_and_keep_parent_links() -> None:
    child = identity_from({"x-session-id": "b", "x-parent-session-id": "a"})
    parent = identity_from({"x-session-id": "a"})
    assert scoped(child, "k1").parent == scoped(parent, "k1").session
    assert scoped(parent, "k1").session != scoped(parent, "k2").session
    assert scoped(SessionIdentity(), "k1") == SessionIdentity()
