"""A sim worker reports a block stored once the step that computes it has ended, as a real
engine does after its forward pass: never while the step's time is still passing."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from deepinfer_gateway.core.protocol import GenerateRequest, KvEventKind, KvTier, Sampling
from deepinfer_gateway.workers.sim.engine import SimEngine
from deepinfer_gateway.workers.sim.kv_events import SimKvEventLog
from deepinfer_gateway.workers.sim.profiles import load_profile


async def test_held_appends_are_unseen_until_published_then_numbered_in_order() -> None:
    log = SimKvEventLog("w")
    start = log.last_seq
    waiting = asyncio.create_task(log.wait_past(start, 10))
    log.hold()
    log.append(KvEventKind.STORED, KvTier.MEMORY, [1, 2])
    log.append(KvEventKind.EVICTED, KvTier.MEMORY, [9])
    await asyncio.sleep(0.02)
    assert log.last_seq == start and log.batch(start).events == [] and not waiting.done()
    log.publish()
    await asyncio.wait_for(waiting, 1)
    events = log.batch(start).events
    assert [(e.seq, e.kind, e.block_hashes) for e in events] == [
        (start + 1, KvEventKind.STORED, [1, 2]), (start + 2, KvEventKind.EVICTED, [9])]
    log.append(KvEventKind.STORED, KvTier.MEMORY, [3])  # not held: seen at once
    assert log.last_seq == start + 3


def _stored(engine: SimEngine) -> list[int]:
    return [h for e in engine.kv_events(0).events if e.kind is KvEventKind.STORED and e.tier is KvTier.MEMORY
            for h in e.block_hashes]


async def test_a_prompts_blocks_are_reported_with_its_first_token_not_when_its_prefill_starts() -> None:
    # One 1,024-token prompt prefilled in one step of ~0.1 s wall (time_scale 0.25).
    profile = replace(load_profile("sm100"), dp_ranks=1, gpus_per_instance=1)
    engine = SimEngine(worker_id="w", profile=profile, time_scale=0.25)
    await engine.start()
    try:
        request = GenerateRequest(request_id="r", token_ids=list(range(1000, 2024)),
                                  sampling=Sampling(max_tokens=2, ignore_eos=True))
        seen: dict[str, list[int]] = {}
        async for event in engine.generate(request):
            if event["event"] not in seen:
                seen[event["event"]] = _stored(engine)
        assert seen["ready"] == []  # scheduled, its step under way: nothing stored yet
        assert len(seen["tokens"]) == 8  # with its first token: the prompt's 8 full blocks
    finally:
        await engine.stop()
