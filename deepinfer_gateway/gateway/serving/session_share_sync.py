"""Sessions' cache capacity across routers, on the routers' exchange (router_exchange.py; the
policy: router/session_capacity.py): this router's live sessions per worker under
`{dgw:sessions}` ([worker, session digest, blocks] rows, the largest contexts first), and the
others' counted against each worker's room (`external_use`); how long its rounds have waited
for each worker under `{dgw:session-waits}` ({worker: seconds}), so that a round yields a
worker to another router's round that has waited longer for it (`external_waits`). Two keys,
so a router of a version before the waits reads the live sessions as it did.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

from deepinfer_gateway.gateway.serving.router_exchange import Heard, RouterExchange
from deepinfer_gateway.router.session_capacity import SessionCapacity, external_use, external_waits

SESSIONS_KEY = "{dgw:sessions}"
WAITS_KEY = "{dgw:session-waits}"
MAX_SESSIONS = 1024  # per report: the largest contexts first
MAX_WAITS = 1024  # workers per waits report


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


def encode_waits(waits: dict[str, float]) -> str:
    return json.dumps(dict(sorted(waits.items(), key=lambda item: -item[1])[:MAX_WAITS]), separators=(",", ":"))


def decode_waits(text: str) -> dict[str, float] | None:
    """A waits report read back; None if it is not one."""
    try:
        raw = json.loads(text)
        if not isinstance(raw, dict):
            return None
        waits = {str(worker): float(seconds) for worker, seconds in list(raw.items())[:MAX_WAITS]}
    except (ValueError, TypeError):
        return None
    return waits if all(math.isfinite(s) and s >= 0 for s in waits.values()) else None


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
        return {SESSIONS_KEY: encode_live(self.policy.live_report(now)),
                WAITS_KEY: encode_waits(self.policy.wait_report(now))}

    def _heard(self, key: str, heard: list[Heard], now: float) -> None:
        if key == WAITS_KEY:
            waits = [(h.at, w) for h in heard if (w := decode_waits(h.text)) is not None]
            self.policy.set_external_waits(external_waits(waits))
        else:
            reports = [r for h in heard if (r := decode_live(h.text)) is not None]
            self.policy.set_external(external_use(reports, self.policy.sessions))
        if self._on_heard is not None:
            self._on_heard()
