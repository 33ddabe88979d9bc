"""The ledger following an engine's KV events (decoded batches, as the subscriber yields them)."""

from __future__ import annotations

from dataclasses import replace

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from quota_service.config import Settings
from quota_service.core.hashing import block_hashes, event_hash
from quota_service.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from quota_service.core.model import EndReason, ReservationState
from quota_service.store.ledger import Ledger
from quota_service.store.reconcile import Reconciler
from tests.integration.invariants import assert_invariants
from tests.integration.ledger_fixtures import add_instance, add_tenant, counters, request

BS = 16
PROMPT = list(range(500, 500 + 4 * BS))


def batch(*events: BlockStored | BlockRemoved | AllBlocksCleared) -> EventBatch:
    return EventBatch(0.0, events, 0)


async def states(engine: AsyncEngine) -> dict[int, tuple[str, bool]]:
    async with engine.connect() as conn:
        rows = await conn.execute(
            text("SELECT block_id, state, engine_confirmed_at IS NOT NULL FROM blocks ORDER BY 1")
        )
        return {r[0]: (r[1], r[2]) for r in rows}


async def prompt_admitted(
    engine: AsyncEngine, settings: Settings
) -> tuple[Ledger, Reconciler, tuple[int, ...]]:
    """Instance gpu-0 (16 blocks) and tenant acme, whose reservation "a" holds PROMPT's four
    hashed blocks; returns the ledger, a reconciler, and those blocks' event hashes."""
    await add_instance(engine, blocks=16)
    await add_tenant(engine, "acme")
    ledger = Ledger(engine, settings.admission_limits)
    _, salt = await ledger.admit(
        replace(request("a", len(PROMPT), 1), prompt_token_ids=tuple(PROMPT))
    )
    hashes = tuple(event_hash(h) for h in block_hashes(PROMPT, BS, salt))
    return ledger, Reconciler(engine, ledger), hashes


async def test_events_confirm_evict_and_count_drift(
    engine: AsyncEngine, settings: Settings
) -> None:
    ledger, reconciler, hashes = await prompt_admitted(engine, settings)
    stored = BlockStored(hashes, None, tuple(PROMPT), BS, "GPU")
    await reconciler.apply("gpu-0", 0, batch(stored))
    assert [states_ for _, states_ in sorted((await states(engine)).items())][:4] == [
        ("IN_USE", True)
    ] * 4

    # The engine evicts two blocks the ledger still references: drift, nothing freed.
    assert await reconciler.apply("gpu-0", 1, batch(BlockRemoved(tuple(hashes[2:]), "GPU"))) == (
        0,
        2,
    )
    # The prompt's four blocks (its one output token never gets a slot).
    assert (await counters(engine))["instance:gpu-0"]["blocks_in_use"] == 4
    # Released, they are cached; when the engine evicts them they are freed and tombstoned.
    await ledger.end("acme", "a", EndReason.RELEASED, 1)
    assert await reconciler.apply("gpu-0", 2, batch(BlockRemoved(tuple(hashes[2:]), "GPU"))) == (
        2,
        0,
    )
    assert [(await states(engine))[i][0] for i in range(4)] == ["CACHED", "CACHED", "FREE", "FREE"]
    async with engine.connect() as conn:
        reasons = (
            (await conn.execute(text("SELECT reason FROM tombstones ORDER BY block_id")))
            .scalars()
            .all()
        )
        drift = (
            await conn.execute(text("SELECT drift_blocks, last_event_seq FROM instances"))
        ).one()
    assert reasons == ["ENGINE_EVICTED", "ENGINE_EVICTED"]
    assert tuple(drift) == (2, 2)
    # Another medium's events are not about this pool.
    assert await reconciler.apply("gpu-0", 3, batch(BlockRemoved(tuple(hashes[:2]), "CPU"))) == (
        0,
        0,
    )
    # AllBlocksCleared frees every cached block.
    assert await reconciler.apply("gpu-0", 4, batch(AllBlocksCleared())) == (2, 0)
    assert (await counters(engine))["instance:gpu-0"]["cached_blocks"] == 0
    # A new request on the same prompt misses: the ledger no longer claims those contents.
    again, _ = await ledger.admit(
        replace(request("b", len(PROMPT), 1), prompt_token_ids=tuple(PROMPT))
    )
    assert again.prefix_hit_blocks == 0
    await assert_invariants(engine)


async def test_a_block_the_engine_stored_twice_stays_until_both_copies_went(
    engine: AsyncEngine, settings: Settings
) -> None:
    """vLLM does not de-duplicate identical blocks (ENGINES.md): two requests computing the same
    prefix at once store it twice, and evicting one copy leaves the other cached."""
    ledger, reconciler, hashes = await prompt_admitted(engine, settings)
    await ledger.end("acme", "a", EndReason.RELEASED, 1)
    stored = BlockStored(hashes, None, tuple(PROMPT), BS, "GPU")
    await reconciler.apply("gpu-0", 0, batch(stored, stored))
    removed = BlockRemoved(hashes[:1], "GPU")
    assert await reconciler.apply("gpu-0", 1, batch(removed)) == (0, 0)  # one copy left
    assert (await states(engine))[0] == ("CACHED", True)
    assert await reconciler.apply("gpu-0", 2, batch(removed)) == (1, 0)  # the last one
    assert (await states(engine))[0] == ("FREE", False)
    # A hash named twice in one event is two copies too; a clear forgets every copy.
    await reconciler.apply("gpu-0", 3, batch(BlockStored(hashes[1:2] * 2, None, (), BS, "GPU")))
    assert await reconciler.apply("gpu-0", 4, batch(BlockRemoved(hashes[1:2], "GPU"))) == (0, 0)
    assert await reconciler.apply("gpu-0", 5, batch(AllBlocksCleared())) == (3, 0)
    async with engine.connect() as conn:
        copies = await conn.execute(text("SELECT sum(engine_copies) FROM blocks"))
        assert copies.scalar_one() == 0
    await assert_invariants(engine)


async def test_an_evicted_copy_is_the_unreferenced_one_of_its_hash(
    engine: AsyncEngine, settings: Settings
) -> None:
    """An exact repeat fills its prompt's last block again (vLLM never hits the last token), so
    engine and ledger both hold that hash twice: the cached copy and the repeat's. The engine
    evicting the cached copy frees the ledger's cached one, and is no drift: the repeat's block
    is referenced in the engine too, so it was not the copy evicted."""
    ledger, reconciler, hashes = await prompt_admitted(engine, settings)
    await reconciler.apply("gpu-0", 0, batch(BlockStored(hashes, None, tuple(PROMPT), BS, "GPU")))
    await ledger.end("acme", "a", EndReason.RELEASED, 1)
    repeat, _ = await ledger.admit(
        replace(request("b", len(PROMPT), 1), prompt_token_ids=tuple(PROMPT))
    )
    assert repeat.prefix_hit_blocks == 3
    refilled = BlockStored(hashes[3:], hashes[2], tuple(PROMPT[3 * BS :]), BS, "GPU")
    await reconciler.apply("gpu-0", 1, batch(refilled))
    assert await reconciler.apply("gpu-0", 2, batch(BlockRemoved(hashes[3:], "GPU"))) == (1, 0)
    now = await states(engine)
    assert {now[h.block_id] for h in repeat.block_table} == {("IN_USE", True)}
    await assert_invariants(engine)


async def test_an_engine_restart_ends_its_reservations(
    engine: AsyncEngine, settings: Settings
) -> None:
    await add_instance(engine, blocks=16)
    await add_instance(engine, "gpu-1", blocks=16)
    await add_tenant(engine, "acme")
    ledger = Ledger(engine, settings.admission_limits)
    await ledger.admit(replace(request("a", len(PROMPT), 1), prompt_token_ids=tuple(PROMPT)))
    await ledger.admit(request("b", 40, 10))
    await ledger.end("acme", "b", EndReason.RELEASED, 1)
    await ledger.admit(request("other", 40, 10, instance="gpu-1"))
    ended = await Reconciler(engine, ledger).resynchronise("gpu-0", 0, restarted=True)
    assert ended == 1
    a = await ledger.get("acme", "a")
    assert (a.state, a.end_reason) == (ReservationState.ENDED, EndReason.ENGINE_RESTARTED)
    assert (await ledger.get("acme", "other")).state is ReservationState.ADMITTED
    books = await counters(engine)
    assert (books["instance:gpu-0"]["blocks_in_use"], books["instance:gpu-0"]["cached_blocks"]) == (
        0,
        0,
    )
    await assert_invariants(engine)
