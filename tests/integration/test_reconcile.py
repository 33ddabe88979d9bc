"""An instance's owner following its engine's KV events (decoded batches, as the subscriber
yields them)."""

from __future__ import annotations

from dataclasses import replace

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from quota_service.api.server import HotPath
from quota_service.core.hashing import block_hashes, event_hash
from quota_service.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from quota_service.core.model import EndReason, ReservationState
from tests.integration.invariants import assert_invariants
from tests.integration.ledger_fixtures import (
    add_instance,
    add_tenant,
    derived_counters,
    request,
    slots,
)

BS = 16
PROMPT = list(range(500, 500 + 4 * BS))


def batch(*events: BlockStored | BlockRemoved | AllBlocksCleared) -> EventBatch:
    return EventBatch(0.0, events, 0)


async def states(engine: AsyncEngine, owned: HotPath) -> dict[int, tuple[str, bool]]:
    """block_id → (state, whether the engine holds a copy) on gpu-0, from its owner's memory
    (`slots` checks the states against the record's view) and the record's copies."""
    held = await slots(engine, owned)
    async with engine.connect() as conn:
        rows = await conn.execute(text("SELECT block_id, engine_copies FROM journal_slots"))
        copies = {r.block_id: r.engine_copies for r in rows}
    return {b: (state, copies.get(b, 0) > 0) for b, (state, _, _) in held.items()}


async def prompt_admitted(engine: AsyncEngine, owned: HotPath) -> tuple[int, ...]:
    """Instance gpu-0 (16 blocks) and tenant acme, whose reservation "a" holds PROMPT's four
    hashed blocks; returns those blocks' event hashes."""
    await add_instance(engine, blocks=16)
    await add_tenant(engine, "acme")
    _, salt = await owned.ledger.admit(
        replace(request("a", len(PROMPT), 1), prompt_token_ids=tuple(PROMPT))
    )
    return tuple(event_hash(h) for h in block_hashes(PROMPT, BS, salt))


async def test_events_confirm_evict_and_count_drift(engine: AsyncEngine, owned: HotPath) -> None:
    hashes = await prompt_admitted(engine, owned)
    ledger, reconciler = owned.ledger, owned.reconciler(engine)
    stored = BlockStored(hashes, None, tuple(PROMPT), BS, "GPU")
    await reconciler.apply("gpu-0", 0, batch(stored))
    assert [states_ for _, states_ in sorted((await states(engine, owned)).items())][:4] == [
        ("IN_USE", True)
    ] * 4

    # The engine evicts two blocks the owner still references: drift, nothing freed.
    assert await reconciler.apply("gpu-0", 1, batch(BlockRemoved(tuple(hashes[2:]), "GPU"))) == (
        0,
        2,
    )
    # The prompt's four blocks (its one output token never gets a slot).
    assert (await derived_counters(engine, owned))["instance:gpu-0"]["blocks_in_use"] == 4
    # Released, they are cached; when the engine evicts them they are freed.
    await ledger.end("acme", "a", EndReason.RELEASED, 1)
    assert await reconciler.apply("gpu-0", 2, batch(BlockRemoved(tuple(hashes[2:]), "GPU"))) == (
        2,
        0,
    )
    assert [(await states(engine, owned))[i][0] for i in range(4)] == [
        "CACHED",
        "CACHED",
        "FREE",
        "FREE",
    ]
    async with engine.connect() as conn:
        drift = (
            await conn.execute(
                text(
                    "SELECT c.drift_blocks, i.last_event_seq FROM instances i "
                    "JOIN instance_pool_counters c USING (instance)"
                )
            )
        ).one()
    assert tuple(drift) == (2, 2)
    # Another medium's events are not about this pool.
    assert await reconciler.apply("gpu-0", 3, batch(BlockRemoved(tuple(hashes[:2]), "CPU"))) == (
        0,
        0,
    )
    # AllBlocksCleared frees every cached block.
    assert await reconciler.apply("gpu-0", 4, batch(AllBlocksCleared())) == (2, 0)
    assert (await derived_counters(engine, owned))["instance:gpu-0"]["cached_blocks"] == 0
    # A new request on the same prompt misses: the owner no longer claims those contents.
    again, _ = await ledger.admit(
        replace(request("b", len(PROMPT), 1), prompt_token_ids=tuple(PROMPT))
    )
    assert again.prefix_hit_blocks == 0
    await assert_invariants(engine)


async def test_a_block_the_engine_stored_twice_stays_until_both_copies_went(
    engine: AsyncEngine, owned: HotPath
) -> None:
    """vLLM does not de-duplicate identical blocks (ENGINES.md): two requests computing the same
    prefix at once store it twice, and evicting one copy leaves the other cached."""
    hashes = await prompt_admitted(engine, owned)
    ledger, reconciler = owned.ledger, owned.reconciler(engine)
    await ledger.end("acme", "a", EndReason.RELEASED, 1)
    stored = BlockStored(hashes, None, tuple(PROMPT), BS, "GPU")
    await reconciler.apply("gpu-0", 0, batch(stored, stored))
    removed = BlockRemoved(hashes[:1], "GPU")
    assert await reconciler.apply("gpu-0", 1, batch(removed)) == (0, 0)  # one copy left
    assert (await states(engine, owned))[0] == ("CACHED", True)
    assert await reconciler.apply("gpu-0", 2, batch(removed)) == (1, 0)  # the last one
    assert (await states(engine, owned))[0] == ("FREE", False)
    # A hash named twice in one event is two copies too; a clear forgets every copy.
    await reconciler.apply("gpu-0", 3, batch(BlockStored(hashes[1:2] * 2, None, (), BS, "GPU")))
    assert await reconciler.apply("gpu-0", 4, batch(BlockRemoved(hashes[1:2], "GPU"))) == (0, 0)
    assert await reconciler.apply("gpu-0", 5, batch(AllBlocksCleared())) == (3, 0)
    assert not any(copied for _, copied in (await states(engine, owned)).values())
    await assert_invariants(engine)


async def test_an_evicted_copy_is_the_unreferenced_one_of_its_hash(
    engine: AsyncEngine, owned: HotPath
) -> None:
    """An exact repeat fills its prompt's last block again (vLLM never hits the last token), so
    engine and owner both hold that hash twice: the cached copy and the repeat's. The engine
    evicting the cached copy frees the owner's cached one, and is no drift: the repeat's block
    is referenced in the engine too, so it was not the copy evicted."""
    hashes = await prompt_admitted(engine, owned)
    ledger, reconciler = owned.ledger, owned.reconciler(engine)
    await reconciler.apply("gpu-0", 0, batch(BlockStored(hashes, None, tuple(PROMPT), BS, "GPU")))
    await ledger.end("acme", "a", EndReason.RELEASED, 1)
    repeat, _ = await ledger.admit(
        replace(request("b", len(PROMPT), 1), prompt_token_ids=tuple(PROMPT))
    )
    assert repeat.prefix_hit_blocks == 3
    refilled = BlockStored(hashes[3:], hashes[2], tuple(PROMPT[3 * BS :]), BS, "GPU")
    await reconciler.apply("gpu-0", 1, batch(refilled))
    assert await reconciler.apply("gpu-0", 2, batch(BlockRemoved(hashes[3:], "GPU"))) == (1, 0)
    now = await states(engine, owned)
    assert {now[h.block_id] for h in repeat.block_table} == {("IN_USE", True)}
    await assert_invariants(engine)


async def test_an_engine_restart_ends_its_reservations(engine: AsyncEngine, owned: HotPath) -> None:
    await add_instance(engine, blocks=16)
    await add_instance(engine, "gpu-1", blocks=16)
    await add_tenant(engine, "acme")
    ledger = owned.ledger
    await ledger.admit(replace(request("a", len(PROMPT), 1), prompt_token_ids=tuple(PROMPT)))
    await ledger.admit(request("b", 40, 10))
    await ledger.end("acme", "b", EndReason.RELEASED, 1)
    await ledger.admit(request("other", 40, 10, instance="gpu-1"))
    ended = await owned.reconciler(engine).resynchronise("gpu-0", 0, restarted=True)
    assert ended == 1
    a = await ledger.get("acme", "a")
    assert (a.state, a.end_reason) == (ReservationState.ENDED, EndReason.ENGINE_RESTARTED)
    assert (await ledger.get("acme", "other")).state is ReservationState.ADMITTED
    books = await derived_counters(engine, owned)
    assert (books["instance:gpu-0"]["blocks_in_use"], books["instance:gpu-0"]["cached_blocks"]) == (
        0,
        0,
    )
    await assert_invariants(engine)
