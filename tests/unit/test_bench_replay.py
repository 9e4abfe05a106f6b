"""Replay scheduling with an in-process sender (no network)."""

from __future__ import annotations

import asyncio
import time

from deepinfer_gateway.loadgen.replay import ReplayConfig, replay
from deepinfer_gateway.workload.types import RequestRecord, TraceRequest


class FakeSender:
    def __init__(self, latency_s: float):
        self.latency_s = latency_s
        self.inflight = self.peak = 0
        self.sent: list[tuple[float, str, int]] = []

    async def send(self, prompt: str, max_tokens: int, record: RequestRecord) -> None:
        self.inflight += 1
        self.peak = max(self.peak, self.inflight)
        self.sent.append((time.perf_counter(), prompt, max_tokens))
        try:
            await asyncio.sleep(self.latency_s)
            record.ttft_s, record.e2e_s, record.output_tokens = 0.001, self.latency_s, max_tokens
        except asyncio.CancelledError:
            record.status, record.error = "error", "cancelled"
            raise
        finally:
            self.inflight -= 1


def trace(n: int, gap_s: float) -> list[TraceRequest]:
    return [TraceRequest(i, i * gap_s, 10, 5, None) for i in range(n)]


async def test_open_loop_follows_the_trace_clock_with_speedup() -> None:
    # A busy machine only makes sends late, never early: the lower bound is exact (the trace's
    # 4 s gaps at 20x), the upper one generous yet far below half the speed-up (1.6 s) or none (16 s).
    sender = FakeSender(0.01)
    result = await replay(trace(5, 4.0), lambda r: f"p{r.index}", sender,
                          ReplayConfig(mode="open", speedup=20.0, progress=False))
    due = [i * 4.0 / 20.0 for i in range(5)]
    sent = [r.arrival_s for r in sorted(result.records, key=lambda r: r.index)]
    assert all(d - 0.001 <= s < d + 0.5 for d, s in zip(due, sent, strict=True)), sent  # 1 ms: timer resolution
    assert [r.index for r in result.records] == list(range(5)) and all(r.ok for r in result.records)
    assert [p for _, p, _ in sender.sent] == [f"p{i}" for i in range(5)]
    assert 0.8 <= result.wall_s < 1.3 and result.client_cpu_s >= 0


async def test_closed_loop_holds_concurrency() -> None:
    sender = FakeSender(0.02)
    result = await replay(trace(20, 100.0), lambda r: "x", sender,
                          ReplayConfig(mode="closed", concurrency=4, progress=False))
    assert sender.peak == 4 and len(result.records) == 20
    assert result.wall_s < 10  # arrival times ignored: the trace spans 1900 s


async def test_duration_bounds_sending_and_cancels_stragglers() -> None:
    # Requests answer in 60 s: the replay ends well before, at its duration plus the drain timeout.
    sender = FakeSender(60.0)
    t0 = time.perf_counter()
    result = await replay(trace(100, 0.01), lambda r: "x", sender,
                          ReplayConfig(mode="open", duration_s=0.1, drain_timeout_s=0.1, progress=False))
    assert time.perf_counter() - t0 < 10
    # Nothing due at or after the duration is sent (a loaded machine may send fewer, never more).
    assert 1 <= len(result.records) <= 10 and all(r.index < 10 for r in result.records)
    assert all(r.error == "cancelled" for r in result.records)
