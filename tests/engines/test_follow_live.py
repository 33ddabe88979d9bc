"""The instance's owner following a real vLLM through its KV events: confirmations, and a
restart. What it applied is read back from the record (the journal's views)."""

from __future__ import annotations

import asyncio
import signal

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from quota_service.core.admission import AdmitRequest
from quota_service.core.hashing import block_hashes, event_hash
from quota_service.core.kv_events import BlockRemoved, BlockStored
from quota_service.core.model import (
    AdmitParams,
    EndReason,
    ReservationState,
)
from quota_service.engine.vllm.subscriber import Received, Subscriber
from tests.engines.conftest import (
    BLOCK_SIZE,
    Followed,
    stop_vllm,
    until,
)
from tests.engines.test_vllm_contract import complete
from tests.integration.invariants import assert_invariants

PROMPT = list(range(1, 2 * BLOCK_SIZE + 5))  # two full blocks, a partial third


async def cached_event_hashes(engine: AsyncEngine) -> set[int]:
    """The event hashes of the slots the record says are cached on instance "live"."""
    query = text(
        "SELECT content_hash FROM journal_slots WHERE instance = 'live' AND state = 'CACHED'"
    )
    async with engine.connect() as conn:
        return {event_hash(bytes(digest)) for (digest,) in await conn.execute(query)}


async def engine_resyncs(engine: AsyncEngine) -> int:
    async with engine.connect() as conn:
        return int((await conn.execute(text("SELECT engine_resyncs FROM instances"))).scalar_one())


async def test_following_a_restarted_engine(followed: Followed, engine: AsyncEngine) -> None:
    ledger, live = followed.ledger, followed.live
    params = AdmitParams("acme", "held", "live", len(PROMPT), 4, 1, 0)
    held, salt = await ledger.admit(AdmitRequest(params, tuple(PROMPT), 0.0, 600.0))
    await complete(live, PROMPT, max_tokens=4, request_id="held", cache_salt=salt)
    ours = block_hashes(PROMPT, BLOCK_SIZE, salt)

    async def confirmed() -> bool:
        async with engine.connect() as conn:
            rows = await conn.execute(
                text(
                    "SELECT count(*) FROM journal_slots "
                    "WHERE instance = 'live' AND engine_copies > 0 AND content_hash = ANY(:h)"
                ),
                {"h": ours},
            )
            return bool(rows.scalar_one() == len(ours))

    await until(confirmed)  # BlockStored confirmed exactly the ledger's prompt blocks
    resyncs_before = await engine_resyncs(engine)

    stop_vllm(followed.process, signal.SIGKILL)
    followed.process = followed.restart()
    await complete(live, [9] * 40, max_tokens=1)  # its first batch numbers from 0 again

    async def resynchronised() -> bool:
        # The reservations end before the cache is forgotten, in a later transaction that
        # also counts the resync: wait for that one, not only for the ended reservation.
        return await engine_resyncs(engine) > resyncs_before

    await until(resynchronised)
    after = await ledger.get("acme", "held")
    assert held.state is ReservationState.ADMITTED
    assert after.end_reason is EndReason.ENGINE_RESTARTED
    async with engine.connect() as conn:
        query = text(
            "SELECT c.cached_blocks, c.blocks_in_use, i.engine_resyncs "
            "FROM journal_pool_counts c JOIN instances i USING (instance)"
        )
        row = (await conn.execute(query)).one()
    assert (row.cached_blocks, row.blocks_in_use) == (0, 0) and row.engine_resyncs >= 2
    await assert_invariants(engine)


async def test_the_ledgers_cache_is_the_engines(followed: Followed, engine: AsyncEngine) -> None:
    """A scripted run that fills the pool and forces evictions: afterwards the ledger's cached
    blocks are exactly those the engine's events say it still caches (of the prompt blocks the
    ledger knows; full output blocks are the engine's own)."""
    engine_cache: set[int] = set()
    known: set[int] = set()
    ledger, live = followed.ledger, followed.live
    watcher = Subscriber(live.events, live.replay)
    watcher.connect()

    async def watch() -> None:
        async for item in watcher.items():
            assert isinstance(item, Received)
            for event in item.batch.events:
                if isinstance(event, BlockStored):
                    engine_cache.update(event.block_hashes)
                elif isinstance(event, BlockRemoved):
                    engine_cache.difference_update(event.block_hashes)

    watching = asyncio.create_task(watch())
    await asyncio.sleep(0.5)
    try:
        for i in range(24):  # 3 full prompt blocks + a tail each: 24 x 3 > 63 evicts
            # Token ids inside the tiny model's vocabulary (512), a different start for each.
            prompt = [(i * 37 + j) % 500 + 1 for j in range(3 * BLOCK_SIZE + 5)]
            params = AdmitParams("acme", f"r{i}", "live", len(prompt), 20, 1, 0)
            _, salt = await ledger.admit(AdmitRequest(params, tuple(prompt), 0.0, None))
            known.update(event_hash(h) for h in block_hashes(prompt, BLOCK_SIZE, salt))
            await complete(live, prompt, max_tokens=20, request_id=f"r{i}", cache_salt=salt)
            await ledger.end("acme", f"r{i}", EndReason.RELEASED, 20)
        assert len(known) == 72 and len(engine_cache & known) < 72  # the engine did evict

        async def caught_up() -> bool:
            return await cached_event_hashes(engine) == engine_cache & known

        await until(caught_up, 10)
        await assert_invariants(engine)
    finally:
        watching.cancel()
        watcher.close()
