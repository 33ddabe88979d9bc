"""Block tables on an instance's pool, served from its owner's memory and journaled: prefix
sharing, the cache, eviction order, stale handles and single-block release, asserted with exact
block ids."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import replace

import pytest
from sqlalchemy import event, text
from sqlalchemy.ext.asyncio import AsyncEngine

from quota_service.api.server import HotPath
from quota_service.core.admission import AdmitRequest
from quota_service.core.block_table import BlockHandle
from quota_service.core.errors import KvQuotaError
from quota_service.core.model import EndReason
from quota_service.owner.owners import OwnedLedger
from tests.integration.invariants import assert_invariants
from tests.integration.ledger_fixtures import (
    add_instance,
    add_tenant,
    derived_counters,
    request,
    slots,
    snapshot,
)

BS = 16
PROMPT = list(range(1000, 1000 + 4 * BS + 5))  # 4 full blocks, a partial fifth


def with_tokens(
    request_id: str,
    tokens: list[int],
    output: int = 11,
    n: int = 1,
    tenant: str = "acme",
    instance: str = "gpu-0",
) -> AdmitRequest:
    base = request(request_id, len(tokens), output, tenant=tenant, instance=instance, n=n)
    return replace(base, prompt_token_ids=tuple(tokens))


@pytest.fixture
async def ledger(engine: AsyncEngine, owned: HotPath) -> OwnedLedger:
    await add_instance(engine, blocks=16)
    await add_tenant(engine, "acme")
    return owned.ledger


async def pool(engine: AsyncEngine, owned: HotPath) -> dict[str, int]:
    return (await derived_counters(engine, owned))["instance:gpu-0"]


async def test_table_layout_and_prefix_sharing(
    ledger: OwnedLedger, engine: AsyncEngine, owned: HotPath
) -> None:
    first, salt = await ledger.admit(with_tokens("a", PROMPT))
    # 4 full prompt blocks (hashed), then the tail: 5 + 11 tokens = 1 block.
    assert [h.block_id for h in first.block_table] == [0, 1, 2, 3, 4]
    assert first.prefix_hit_blocks == 0
    second, _ = await ledger.admit(with_tokens("b", PROMPT, n=2))
    assert second.prefix_hit_blocks == 4
    assert [h.block_id for h in second.block_table] == [0, 1, 2, 3, 5, 6]  # shared prefix, 2 tails
    assert second.reserved_blocks == 6
    states = await slots(engine, owned)
    assert [states[i][1] for i in range(7)] == [2, 2, 2, 2, 1, 1, 1]
    counts = await derived_counters(engine, owned)
    assert counts["tenant:acme"]["blocks_in_use"] == 7  # distinct: sharing within a tenant is free
    assert counts["instance:gpu-0"]["blocks_in_use"] == 7
    assert len(salt) >= 32
    await assert_invariants(engine)


async def test_released_prefix_stays_cached_and_is_reused(
    ledger: OwnedLedger, engine: AsyncEngine, owned: HotPath
) -> None:
    first, _ = await ledger.admit(with_tokens("a", PROMPT))
    tail = first.block_table[4]
    await ledger.end("acme", "a", EndReason.RELEASED, 1)
    states = await slots(engine, owned)
    assert [states[i][0] for i in range(5)] == ["CACHED"] * 4 + ["FREE"]
    # The private tail was freed: its generation moved on, so its old handle is stale.
    assert states[4][2] == tail.generation + 1
    assert (await pool(engine, owned))["cached_blocks"] == 4
    again, _ = await ledger.admit(with_tokens("b", PROMPT))
    assert again.prefix_hit_blocks == 4
    assert [h.block_id for h in again.block_table] == [0, 1, 2, 3, 4]
    assert again.block_table[:4] == first.block_table[:4]
    assert again.block_table[4] == BlockHandle(4, tail.generation + 1)
    await assert_invariants(engine)


async def test_never_hashed_slots_first_then_lru_tail_before_head(
    ledger: OwnedLedger, engine: AsyncEngine
) -> None:
    other = [t + 50_000 for t in PROMPT]
    a, _ = await ledger.admit(with_tokens("a", PROMPT))  # blocks 0-4
    await ledger.admit(with_tokens("b", other))  # blocks 5-9
    await ledger.end("acme", "a", EndReason.RELEASED, 1)  # 0-3 cached (older), 4 freed
    await ledger.end("acme", "b", EndReason.RELEASED, 1)  # 5-8 cached (newer), 9 freed
    # 16 slots: 10-15 never hashed, 4 and 9 freed, 0-3 and 5-8 cached. A 12-block private request
    # takes the 8 free ones first (by id), then the LRU cached: a's tail before a's head.
    big, _ = await ledger.admit(request("c", 12 * BS - 11, 11))
    ids = [h.block_id for h in big.block_table]
    assert ids == [4, 9, 10, 11, 12, 13, 14, 15, 3, 2, 1, 0]
    # a's prefix was evicted: its slots are at the generation after the one it cached.
    evicted = {h.block_id: h.generation + 1 for h in a.block_table[:4]}
    assert {h.block_id: h.generation for h in big.block_table[8:]} == evicted
    # b's prefix is still cached; a's is gone: a new request for it misses.
    hit_b, _ = await ledger.admit(with_tokens("d", other[: 2 * BS + 1], 1))
    assert hit_b.prefix_hit_blocks == 2
    await ledger.end("acme", "c", EndReason.RELEASED, 1)
    miss_a, _ = await ledger.admit(with_tokens("e", PROMPT[: 2 * BS], 1))
    assert miss_a.prefix_hit_blocks == 0
    await assert_invariants(engine)


async def test_salts_keep_tenants_apart(ledger: OwnedLedger, engine: AsyncEngine) -> None:
    await add_tenant(engine, "globex")
    await ledger.admit(with_tokens("a", PROMPT))
    theirs, _ = await ledger.admit(with_tokens("a", PROMPT, tenant="globex"))
    assert theirs.prefix_hit_blocks == 0
    assert {h.block_id for h in theirs.block_table}.isdisjoint(range(5))
    await assert_invariants(engine)


async def test_release_blocks(ledger: OwnedLedger, engine: AsyncEngine, owned: HotPath) -> None:
    admitted, _ = await ledger.admit(with_tokens("a", PROMPT, 30))
    table = admitted.block_table  # 4 prompt blocks + 3 tail blocks (5 + 30 tokens)
    assert len(table) == 7
    after = await ledger.release_blocks("acme", "a", [table[6], table[5]])
    assert after.block_table == table[:5]
    assert (await derived_counters(engine, owned))["tenant:acme"]["blocks_in_use"] == 5
    # A full prompt block stays cached at its generation: releasing it again changes nothing.
    released = await ledger.release_blocks("acme", "a", [table[3]])
    before = await snapshot(engine)
    assert (await ledger.release_blocks("acme", "a", [table[3]])) == released
    assert released.reserved_blocks == 4  # what it holds now
    assert await snapshot(engine) == before
    # A freed tail block's generation moved on: its handle is stale, for the reservation that
    # released it too (the slot may hold another tenant's data by now).
    with pytest.raises(KvQuotaError) as stale:
        await ledger.release_blocks("acme", "a", [table[4], table[6]])
    assert stale.value.reason == "STALE_BLOCK_HANDLE"
    assert "freed since" in stale.value.message
    with pytest.raises(KvQuotaError) as unborn:
        await ledger.release_blocks("acme", "a", [BlockHandle(table[0].block_id, 7)])
    assert "never had" in unborn.value.message
    assert await snapshot(engine) == before  # not even the valid handle was released
    table = (*table[:3], table[4])

    other, _ = await ledger.admit(request("b", 10, 10))
    before = await snapshot(engine)
    with pytest.raises(KvQuotaError) as foreign:
        await ledger.release_blocks("acme", "a", [table[0], other.block_table[0]])
    assert foreign.value.reason == "INVALID_REQUEST"
    assert await snapshot(engine) == before

    await ledger.end("acme", "b", EndReason.CANCELLED)
    await ledger.end("acme", "a", EndReason.RELEASED, 30)
    assert (await pool(engine, owned))["blocks_in_use"] == 0
    with pytest.raises(KvQuotaError) as ended:
        await ledger.release_blocks("acme", "a", [table[0]])
    assert (ended.value.reason, ended.value.metadata["endReason"]) == (
        "RESERVATION_ENDED",
        "RELEASED",
    )
    await assert_invariants(engine)


async def test_concurrent_sharers_count_exactly(
    ledger: OwnedLedger, engine: AsyncEngine, owned: HotPath
) -> None:
    await add_instance(engine, "gpu-1", blocks=400)
    tokens = list(range(10 * BS + 1))  # ten full blocks every request can hit, and a tail
    results = await asyncio.gather(
        *(ledger.admit(with_tokens(f"r{i}", tokens, 1, instance="gpu-1")) for i in range(30))
    )
    async with engine.connect() as conn:
        refs = await conn.execute(
            text(
                "SELECT ref_count FROM journal_slots "
                "WHERE instance = 'gpu-1' AND content_hash IS NOT NULL"
            )
        )
        assert [r.ref_count for r in refs] == [30] * 10
    states = await slots(engine, owned, "gpu-1")
    assert sorted(refs for _, refs, _ in states.values()) == [0] * 360 + [1] * 30 + [30] * 10
    assert sum(r.prefix_hit_blocks for r, _ in results) == 29 * 10
    await assert_invariants(engine)


async def test_prefix_hit_racing_eviction(
    ledger: OwnedLedger, engine: AsyncEngine, owned: HotPath
) -> None:
    """A prefix hit and the eviction of the same cached blocks, concurrently: either the hit wins
    (blocks kept, referenced) or the eviction does (a miss on fresh slots); never a reference to
    a slot that was reused."""
    for attempt in range(5):
        tokens = [attempt * 100_000 + t for t in PROMPT]
        await ledger.admit(with_tokens(f"seed{attempt}", tokens))
        await ledger.end("acme", f"seed{attempt}", EndReason.RELEASED, 1)
        free = (await pool(engine, owned))["free_blocks"]
        hit, _ = await asyncio.gather(
            ledger.admit(with_tokens(f"hit{attempt}", tokens)),
            ledger.admit(request(f"evict{attempt}", (free + 4) * BS - 1, 1)),
            return_exceptions=True,
        )
        if not isinstance(hit, BaseException):
            assert hit[0].prefix_hit_blocks in (0, 4)
        await assert_invariants(engine)
        for name in (f"hit{attempt}", f"evict{attempt}"):
            with suppress(KvQuotaError):  # a refused request has nothing to end
                await ledger.end("acme", name, EndReason.RELEASED, 1)


@contextmanager
def statements(engine: AsyncEngine) -> Iterator[list[str]]:
    """The statements the calling task sends through the engine (not the lease rounds that run
    beside it)."""
    seen: list[str] = []
    caller = asyncio.current_task()

    def count(*args: object) -> None:
        if asyncio.current_task() is caller:
            seen.append(str(args[2]))

    event.listen(engine.sync_engine, "before_cursor_execute", count)
    try:
        yield seen
    finally:
        event.remove(engine.sync_engine, "before_cursor_execute", count)


async def test_round_trips_do_not_grow_with_the_request(
    ledger: OwnedLedger, engine: AsyncEngine, owned: HotPath
) -> None:
    """Statements through the engine, and the owner's batches (each one round trip)."""
    await add_instance(engine, "big", blocks=400)
    owner = await owned.owners.owner("big")  # claimed first: the claim is no request's cost
    sizes = {}
    for blocks_wanted in (1, 96):
        tokens = list(range(blocks_wanted * BS + 1))
        batches = owner.stats.batches
        with statements(engine) as seen:
            await ledger.admit(with_tokens(f"n{blocks_wanted}", tokens, 1, instance="big"))
            await ledger.end("acme", f"n{blocks_wanted}", EndReason.RELEASED, 1)
        sizes[blocks_wanted] = (len(seen), owner.stats.batches - batches)
    assert sizes[1] == sizes[96]
