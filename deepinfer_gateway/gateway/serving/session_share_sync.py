"""Sessions' cache capacity across routers, on the routers' exchange (router_exchange.py; the
policy: router/session_capacity.py): this router's live sessions per worker under
`{dgw:sessions}` ([worker, session digest, blocks] rows, the largest contexts first), and the
others' counted against each worker's room (`external_use`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from deepinfer_gateway.gateway.serving.router_exchange import Heard, RouterExchange
from deepinfer_gateway.router.session_capacity import SessionCapacity, external_use

SESSIONS_KEY = "{dgw:sessions}"
MAX_SESSIONS = 1024  # per report: the largest contexts first


def encode_live(live: dict[str, dict[str, int]]) -> str:
    rows = sorted(((worker, session, blocks) for worker, on in live.items() for session, blocks in on.items()),
                  key=lambda row: -row[2])
    return json.dumps(rows[:MAX_SESSIONS], separators=(",", ":"))


def decode_live(text: str) -> dict[str, dict[str, int]] | None:
    """A report read back; None if it is not one (another version's, or damaged)."""
    live: dict[str, dict[str, int]] = {}
    try:
        for worker, session, blocks in json.loads(text)[:MAX_SESSIONS]:
            live.setdefault(str(worker), {})[str(session)] = int(blocks)
    except (ValueError, TypeError, KeyError):
        return None
    return live


class SessionShareSync:
    def __init__(self, redis: Any, policy: SessionCapacity, interval_s: float,
                 on_error: Callable[[], None] | None = None, on_heard: Callable[[], None] | None = None) -> None:
        """`on_heard`: after each exchange (the room the others leave may have changed)."""
        self.policy = policy
        self._on_heard = on_heard
        self.exchange = RouterExchange(redis, "session capacity's shared live sessions", interval_s, self._reports,
                                       self._heard, self._busy, on_error)

    async def touched(self, now: float) -> None:
        """A session's round came (`now`: the loop's clock): exchange while session traffic lasts."""
        await self.exchange.touched(now)

    async def close(self) -> None:
        await self.exchange.close()

    def _busy(self) -> bool:
        """Sessions live here (the others count them) or rounds waiting (for the others' to end)."""
        return self.policy.any_live() or self.policy.any_waiting()

    def _reports(self, now: float) -> dict[str, str]:
        return {SESSIONS_KEY: encode_live(self.policy.live_report(now))}

    def _heard(self, key: str, heard: list[Heard], now: float) -> None:
        reports = [r for h in heard if (r := decode_live(h.text)) is not None]
        self.policy.set_external(external_use(reports, self.policy.sessions))
        if self._on_heard is not None:
            self._on_heard()
