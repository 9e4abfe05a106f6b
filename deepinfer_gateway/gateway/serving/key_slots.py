"""A cap on the generation requests one API key has in flight in this gateway process.

A request takes a slot before its body is prepared and gives it back when it ends, however
it ends (a stream: when its response closes). Beyond `cap` the key is answered 429: one key
cannot hold every connection, worker slot and relay of a process. Without API keys
(authentication off) every caller is the same anonymous key, which is not capped.
"""

from __future__ import annotations

from collections.abc import Callable

from deepinfer_gateway.config import ApiKey
from deepinfer_gateway.core.errors import RateLimited
from deepinfer_gateway.gateway.serving.auth import ANONYMOUS


def _nothing() -> None:
    return None


class KeySlots:
    def __init__(self, cap: int | None):
        self.cap = cap
        self._held: dict[str, int] = {}  # key digest -> requests in flight

    def held(self, key: ApiKey) -> int:
        return self._held.get(key.key_sha256, 0)

    def take(self, key: ApiKey) -> Callable[[], None]:
        """A slot for `key`, or RateLimited; returns its release, which acts once however often called."""
        if self.cap is None or key is ANONYMOUS:
            return _nothing
        digest = key.key_sha256
        held = self._held.get(digest, 0)
        if held >= self.cap:
            raise RateLimited(f"API key {key.name} has {held} requests in flight, its limit; retry when one ends.",
                              headers={"retry-after": "1"})
        self._held[digest] = held + 1
        released = False

        def release() -> None:
            nonlocal released
            if released:
                return
            released = True
            left = self._held[digest] - 1
            if left:
                self._held[digest] = left
            else:
                del self._held[digest]

        return release
