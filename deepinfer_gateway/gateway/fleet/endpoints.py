"""What a discovery source answers: the `Endpoint`s of a pool, through the `Resolver` seam that
gateway/fleet/discovery.py follows (DNS there, an InferencePool's pods in kube_discovery.py).
A leaf: it imports no sibling."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class LookupFailed(Exception):
    """The pool could not be read this time (no answer, as opposed to an answer of nothing)."""


@dataclass(frozen=True, order=True)
class Endpoint:
    host: str  # an IP address
    port: int

    def url(self, scheme: str) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{scheme}://{host}:{self.port}"


class Resolver(Protocol):
    """One pool's endpoints. `resolve` raises LookupFailed when no answer came (an empty answer
    is an empty set); `changed` returns when the next `resolve` is due: after `timeout_s`, or
    sooner when the source learns of a change (a watch); `aclose` ends what the source runs."""

    async def resolve(self) -> set[Endpoint]: ...

    async def changed(self, timeout_s: float) -> None: ...

    async def aclose(self) -> None: ...
