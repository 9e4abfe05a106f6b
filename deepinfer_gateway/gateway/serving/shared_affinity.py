"""The session -> worker memory every gateway replica shares, in Redis, so a session's
follow-ups stay on one worker whichever replica serves them.

The planner stays pure: before planning, `lineage` reads where the session's last request
went (and, for a subagent's first request, where its parent's did) into the `Lineage` the
planner gets; after it, `remember` writes the chosen worker. One key per session,
`{dgw:aff:<scoped session digest>}` (its own hash tag: spread over a Redis Cluster's slots),
expiring `ttl_s` after its last request: the memory is volatile and rebuilds itself (a lost
key costs one request placed by the pool policy). Redis errors fall back to this replica's own
memory (SessionAffinity's), counted and logged once per outage.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from deepinfer_gateway.core.outage import Outage
from deepinfer_gateway.core.session_identity import SessionIdentity
from deepinfer_gateway.router.policy import Lineage


def affinity_key(session: str) -> str:
    return "{dgw:aff:" + session + "}"


def _text(value: Any) -> str | None:
    return value.decode() if isinstance(value, bytes) else value


class SharedAffinity:
    def __init__(self, redis: Any, ttl_s: float, on_error: Callable[[], None] | None = None):
        self._redis = redis
        self._ttl_ms = max(1, int(ttl_s * 1000))
        self._outage = Outage("session affinity", "keeping sessions by this replica's own memory", on_error)

    async def lineage(self, identity: SessionIdentity) -> Lineage:
        """What the replicas remember of the session and its parent (`shared` False when Redis failed)."""
        local = Lineage(parent_key=identity.parent)
        if identity.session is None or not self._outage.due():
            return local
        try:
            own = _text(await self._redis.get(affinity_key(identity.session)))
            parent = None
            if own is None and identity.parent is not None:  # a subagent's first request
                parent = _text(await self._redis.get(affinity_key(identity.parent)))
        except Exception as exc:  # any Redis failure: the local memory
            self._outage.failed(exc)
            return local
        self._outage.ok()
        return Lineage(identity.parent, shared=True, session_worker=own, parent_worker=parent)

    async def remember(self, session: str | None, worker_id: str) -> None:
        """The session's request went to `worker_id`: written with a fresh expiry (also when unchanged,
        so an active session is not forgotten)."""
        if session is None or not self._outage.due():
            return
        try:
            await self._redis.set(affinity_key(session), worker_id, px=self._ttl_ms)
        except Exception as exc:
            self._outage.failed(exc)
            return
        self._outage.ok()
