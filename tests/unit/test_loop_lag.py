"""LoopLag on a real event loop: a synchronous stall shows as lateness, and a timeout over a
span the loop itself was held up is not held against the worker (WorkerRegistry)."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

from deepinfer_gateway.config import DgwWorkerSpec, HealthSettings
from deepinfer_gateway.gateway.fleet.registry import WorkerRegistry
from deepinfer_gateway.gateway.telemetry.loop_lag import LoopLag
from deepinfer_gateway.gateway.telemetry.metrics import GatewayMetrics


async def test_a_blocked_loop_is_seen_late_and_blamed_on_itself() -> None:
    metrics = GatewayMetrics()
    lag = LoopLag(interval_s=0.02, histogram=metrics.loop_lag)
    lag.start()
    try:
        # A healthy loop ticks on time. A busy machine can still deschedule this process (a stall
        # LoopLag rightly counts): one of three spans must be clean.
        for _ in range(3):
            since = lag.now()
            await asyncio.sleep(0.2)
            if lag.own_stall_s(since) < 0.1 and not lag.blames_self(since):
                break
        else:
            raise AssertionError(f"three healthy spans blamed on the loop: {lag.own_stall_s(since):.3f} s held")
        since = lag.now()
        time.sleep(0.5)  # the loop is held: no tick can run
        await asyncio.sleep(0.05)
        assert lag.own_stall_s(since) >= 0.4
        assert lag.blames_self(since)
        assert (metrics.registry.get_sample_value("dgw_event_loop_lag_seconds_count") or 0) > 5
        under = {le: metrics.registry.get_sample_value("dgw_event_loop_lag_seconds_bucket", {"le": le}) or 0
                 for le in ("0.25", "1.0")}
        assert under["0.25"] < under["1.0"]  # the stall landed in (0.25, 1] s
    finally:
        lag.stop()


async def test_timeouts_during_the_gateways_own_stall_do_not_eject_a_worker() -> None:
    metrics = GatewayMetrics()
    client: Any = SimpleNamespace(upstream=lambda spec: None)  # no health checks run here
    registry = WorkerRegistry((DgwWorkerSpec(url="http://w1.test"),), client, HealthSettings(failures_to_eject=2),
                              metrics, loop_lag=LoopLag(interval_s=0.02, histogram=metrics.loop_lag))
    registry.loop_lag.start()
    try:
        (state,) = registry.workers.values()
        state.healthy = True
        for _ in range(3):
            since = registry.loop_lag.now()
            time.sleep(0.3)  # the timeout fired after this process stalled
            await asyncio.sleep(0.03)
            registry.record_failure(state, "connect timed out", since=since)
        assert state.healthy and state.consecutive_failures == 0
        assert metrics.registry.get_sample_value("dgw_stall_timeouts_total") == 3
        # The same timeouts on a loop that ran on time are the worker's. A busy machine can still
        # deschedule this process during a span (rightly not counted): two of six must be on time.
        on_time = 0
        for _ in range(6):
            since = registry.loop_lag.now()
            await asyncio.sleep(0.3)
            on_time += not registry.loop_lag.blames_self(since)
            registry.record_failure(state, "connect timed out", since=since)
            if on_time == 2:
                break
        assert on_time == 2, "five of six spans blamed on this process's own loop"
        assert not state.healthy and state.consecutive_failures == 2
    finally:
        registry.loop_lag.stop()


async def test_the_timer_sleeps_while_idle_and_a_call_wakes_it_with_stalls_still_seen() -> None:
    metrics = GatewayMetrics()
    lag = LoopLag(interval_s=0.01, histogram=metrics.loop_lag, idle_after_s=0.1)

    def ticks() -> float:
        return metrics.registry.get_sample_value("dgw_event_loop_lag_seconds_count") or 0

    lag.start()
    try:
        await asyncio.sleep(0.3)  # no call and nothing busy: the timer stops after idle_after_s
        idle = ticks()
        await asyncio.sleep(0.3)
        assert ticks() == idle and 5 <= idle <= 20
        since = lag.now()  # a call begins: the timer runs again and sees the stall
        time.sleep(0.3)
        await asyncio.sleep(0.03)
        assert lag.blames_self(since) and ticks() > idle
        lag.busy = lambda: True  # work in flight keeps it ticking past idle_after_s
        lag.now()
        await asyncio.sleep(0.3)
        busy = ticks()
        await asyncio.sleep(0.1)
        assert ticks() > busy
    finally:
        lag.stop()
