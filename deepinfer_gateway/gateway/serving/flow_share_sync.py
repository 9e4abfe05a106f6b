"""Flow control's fair share across routers, on the routers' exchange (router_exchange.py; the
policy: router/flow_share.py): each pool's `SharedShare`, and its report under
`{dgw:flow:<pool>}`: this router's queued requests per band and tenant and its tenants' service.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from deepinfer_gateway.gateway.serving.router_exchange import Heard, RouterExchange
from deepinfer_gateway.router.flow import FlowPolicy
from deepinfer_gateway.router.flow_share import SharedShare, decode, encode


def share_key(pool: str) -> str:
    return "{dgw:flow:" + pool + "}"


class FlowShareSync:
    """Every pool's `SharedShare` (`share_of`, for FlowPolicy) and their exchange."""

    def __init__(self, redis: Any, half_life_s: float, interval_s: float,
                 on_error: Callable[[], None] | None = None,
                 on_routers: Callable[[str, int], None] | None = None) -> None:
        """`on_routers(pool, n)`: how many other routers' fresh reports a sync heard."""
        self.policy: FlowPolicy | None = None  # the queues reported: the policy built with `share_of`
        self.shares: dict[str, SharedShare] = {}
        self._pools: dict[str, str] = {}  # key -> pool
        self.half_life_s = half_life_s
        self._on_routers = on_routers
        self.exchange = RouterExchange(redis, "flow control's shared fair share", interval_s, self._reports,
                                       self._heard, self._busy, on_error)

    def share_of(self, pool: str) -> SharedShare:
        share = self.shares.get(pool)
        if share is None:
            share = self.shares[pool] = SharedShare(self.half_life_s, self.exchange.stale_s)
            self._pools[share_key(pool)] = pool
        return share

    async def admitted(self, now: float) -> None:
        """A request came under flow control (`now`: the loop's clock): exchange while traffic lasts."""
        await self.exchange.touched(now)

    async def sync(self) -> None:
        await self.exchange.sync()

    async def close(self) -> None:
        await self.exchange.close()

    def _busy(self) -> bool:
        return self.policy is not None and bool(self.policy.waiting_pools())

    def _reports(self, now: float) -> dict[str, str]:
        policy = self.policy
        if policy is None:
            return {}
        return {share_key(pool): encode(share.report(policy.pool(pool).queued_by_tenant(), now))
                for pool, share in self.shares.items()}

    def _heard(self, key: str, heard: list[Heard], now: float) -> None:
        pool = self._pools[key]
        share = self.shares[pool]
        share.heard([r for h in heard if (r := decode(h.text, h.at)) is not None])
        if self._on_routers is not None:
            self._on_routers(pool, len(share.others))
