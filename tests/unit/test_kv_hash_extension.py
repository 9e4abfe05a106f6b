"""Extending a chain of block hashes gives exactly the hashes of the whole sequence, and
the sim worker's finish-time caching (which extends the prompt's chain) stores exactly
what hashing prompt + output from scratch gives."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer_gateway.core.protocol import FinishReason, KvEventKind, KvTier
from deepinfer_gateway.kvcache.hashing import (
    BlockHashes,
    PrefixHasher,
    block_hashes,
    extend_block_hashes,
    kv_salt,
)
from deepinfer_gateway.workers.sim.core import SchedulerCore, SimRequest
from deepinfer_gateway.workers.sim.kv_events import SimKvEventLog
from deepinfer_gateway.workers.sim.kv_store import InMemoryKvStore
from deepinfer_gateway.workers.sim.profiles import load_profile

BT = 4
SALT = kv_salt("model", "sm100")
tokens = st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=40)


@given(tokens, tokens, tokens)
def test_extension_equals_hashing_the_whole_sequence(a: list[int], b: list[int], c: list[int]) -> None:
    whole = a + b + c
    known = block_hashes(a, SALT, BT)
    first = extend_block_hashes(known, (a + b)[len(known) * BT :], BT)
    assert first == block_hashes(a + b, SALT, BT)
    second = extend_block_hashes(first, whole[len(first) * BT :], BT)  # an extension extends again
    assert second == block_hashes(whole, SALT, BT)
    assert second.salt == SALT and second.chain_tail == block_hashes(whole, SALT, BT).chain_tail  # type: ignore[attr-defined]
    assert known == block_hashes(a, SALT, BT)  # the known chain is left as it was


@given(tokens)
def test_an_empty_chain_extends_from_the_salt(a: list[int]) -> None:
    empty = block_hashes(a[: BT - 1], SALT, BT)
    assert empty == [] and empty.chain_tail == SALT  # type: ignore[attr-defined]
    assert extend_block_hashes(empty, a, BT) == block_hashes(a, SALT, BT)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=0, max_size=60), st.lists(st.integers(0, 50), max_size=60))
def test_prefix_hasher_chains_extend_too(prompt: list[int], more: list[int]) -> None:
    salts = [SALT, kv_salt("model", "ascend950")]
    hashed = PrefixHasher(block_tokens=BT).hashes(prompt, salts)
    for salt, known in zip(salts, hashed, strict=True):
        assert isinstance(known, BlockHashes) and known.salt == salt
        rest = (prompt + more)[len(known) * BT :]
        assert extend_block_hashes(known, rest, BT) == block_hashes(prompt + more, salt, BT)


def test_block_hashes_read_as_a_plain_list() -> None:
    h = block_hashes(list(range(1024)), SALT)
    assert len(h) == 8 and h == list(h) and type(h[:2]) is list


# --- the sim worker: finish caches prompt + output under the hashes of the whole sequence ---

PROFILE = replace(load_profile("sm100"), dp_ranks=1, gpus_per_instance=1)


def _stored(core: SchedulerCore, tier: KvTier) -> list[int]:
    return [h for e in core.events.batch(0).events if e.kind is KvEventKind.STORED and e.tier is tier
            for h in e.block_hashes]


@settings(max_examples=15, deadline=None)
@given(st.integers(1, 700), st.integers(1, 400), st.booleans())
def test_finish_caches_the_whole_sequence_chain(prompt_len: int, n_out: int, from_gateway: bool) -> None:
    core = SchedulerCore(PROFILE, SimKvEventLog("w"), "m", store=InMemoryKvStore())
    prompt = [(i * 7919) % 100_000 for i in range(prompt_len)]
    output = [(i * 104_729) % 100_000 for i in range(n_out)]
    # The gateway hands over hashes it computed (with its PrefixHasher); a plain list carries no chain.
    given_hashes = PrefixHasher().hashes(prompt, [core.salt])[0] if from_gateway else None
    core.add_request(SimRequest("r", prompt, output, FinishReason.LENGTH), given_hashes)
    while core.has_work():
        core.step(0.0)
    whole = block_hashes(prompt + output, core.salt)
    assert set(_stored(core, KvTier.MEMORY)) == set(whole)
    assert set(_stored(core, KvTier.STORE)) == set(whole)
    assert core.cache.match(whole) == len(whole)


def test_finish_with_a_chainless_or_foreign_prefix_hashes_from_scratch() -> None:
    core = SchedulerCore(PROFILE, SimKvEventLog("w"), "m", store=InMemoryKvStore())
    prompt, output = list(range(300)), list(range(1000, 1300))
    foreign = block_hashes(prompt, kv_salt("m", "ascend950"))  # another format's chain: not extended
    core.add_request(SimRequest("r", prompt, output, FinishReason.LENGTH), foreign)
    while core.has_work():
        core.step(0.0)
    ours = block_hashes(prompt + output, core.salt)
    assert core.cache.match(ours) == len(ours)
    assert core.hashes(prompt + output, list(foreign)) == ours  # plain list: hashed from scratch
    assert core.hashes(prompt + output, block_hashes(prompt, core.salt)) == ours


# --- the shared store's put: same blocks, expiries, order and events as the plain rule ---


def _reference_put(blocks: dict[int, float], hashes: list[int], ttl: float, now: float, capacity: int
                   ) -> tuple[list[int], list[int]]:
    """The rule spelled out: back to front, each block popped and re-added with the later expiry."""
    stored = []
    for h in reversed(hashes[:capacity]):
        old = blocks.pop(h, None)
        if old is None or old <= now:
            stored.append(h)
        blocks[h] = max(now + ttl, old or 0.0)
    stored.reverse()
    evicted = [h for h in list(blocks)[: max(0, len(blocks) - capacity)]]
    for h in evicted:
        del blocks[h]
    return stored, evicted


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 12), st.lists(st.tuples(st.lists(st.integers(0, 15), max_size=10),
                                              st.sampled_from(["agent", "chat"]), st.integers(0, 3)), max_size=25))
def test_store_put_follows_the_plain_rule(capacity: int, puts: list[tuple[list[int], str, int]]) -> None:
    store = InMemoryKvStore(capacity_blocks=capacity, ttl_s={"agent": 2.0, "chat": 5.0})
    expected: dict[int, float] = {}
    now = 0.0
    for hashes, workload, advance in puts:  # repeated hashes and expired blocks included
        now += advance
        put = store.put(hashes, workload, now)
        assert (put.stored, put.evicted) == _reference_put(expected, hashes, store.ttl_s[workload], now, capacity)
        assert list(store._blocks.items()) == list(expected.items())
