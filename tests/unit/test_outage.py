"""Outage: while Redis is failing, the request path skips it except for one probe per interval."""

from __future__ import annotations

from deepinfer_gateway.core.outage import Outage


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_during_an_outage_only_one_call_per_interval_probes_redis() -> None:
    clock, errors = Clock(), []
    outage = Outage("test", "falling back", lambda: errors.append(1), retry_interval_s=1.0, clock=clock)
    assert outage.due() and outage.due()  # healthy: every call goes to Redis
    outage.failed(OSError("hung"))
    assert errors == [1] and outage.active
    assert not outage.due()
    clock.now += 0.99
    assert not outage.due()
    clock.now += 0.02
    assert outage.due()  # the probe
    assert not outage.due()  # the others keep the fallback while it runs
    outage.failed(OSError("still hung"))  # the probe failed: another interval
    clock.now += 0.5
    assert not outage.due()
    clock.now += 0.5
    assert outage.due()
    outage.ok()  # the probe succeeded
    assert not outage.active and outage.due() and outage.due()
