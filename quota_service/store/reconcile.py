"""Reconciliation: the ledger follows what the engine reports it holds.

- BlockStored: the engine holds a copy of these contents. Neither the engine nor the ledger
  de-duplicates identical blocks, and an event names a hash, not a block: the copy is counted
  on one ledger block with that hash, the one with the fewest copies (a block being filled now
  has none). Blocks the ledger does not know, such as full output blocks, are the engine's own.
- BlockRemoved: the engine evicted a copy, and it evicts only blocks nothing references, so the
  copy is taken off an unreferenced ledger block with that hash when there is one. Once a ledger
  block's last copy went, it is freed and tombstoned (ENGINE_EVICTED) if nothing references
  it; if the ledger still references it, that is drift, counted on the instance and left alone
  (the reservation holding it still owns its budget).
- AllBlocksCleared, and any resynchronisation: the engine holds no copies; every cached,
  unreferenced block is freed (ENGINE_CLEARED); after an engine restart the live reservations on
  it end (ENGINE_RESTARTED), since the engine lost their work.
Only GPU-medium events speak of the instance's pool; CPU and storage tiers come with reclaim.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from quota_service.core.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
)
from quota_service.core.model import EndReason
from quota_service.store import blocks
from quota_service.store.database import driver_statement, in_transaction
from quota_service.store.ledger import Ledger

log = logging.getLogger(__name__)

GPU = "GPU"

# An event's hashes with how often each appears (an event may name a hash twice).
_COPIES = (
    "(SELECT h, count(*)::int AS copies FROM unnest(CAST(:hashes AS bigint[])) AS h GROUP BY h)"
)

# The one ledger block per hash that a stored copy lands on: fewest copies first, referenced
# (being filled now) before cached.
_STORED = text(
    f"""
    WITH pick AS (
        SELECT DISTINCT ON (b.event_hash) b.block_id, e.copies
        FROM blocks b JOIN {_COPIES} e ON b.event_hash = e.h
        WHERE b.instance = :instance
        ORDER BY b.event_hash, b.engine_copies, b.ref_count = 0, b.block_id
    )
    UPDATE blocks b SET engine_confirmed_at = now(), engine_copies = b.engine_copies + p.copies
    FROM pick p
    WHERE b.instance = :instance AND b.block_id = p.block_id
    """
)

# The one ledger block per hash that an evicted copy is taken from: unreferenced ones first
# (the engine evicts only those), counted copies before uncounted. A referenced block the engine
# never reported is not the copy it evicted. Returns the blocks whose last copy went.
_REMOVED = text(
    f"""
    WITH pick AS (
        SELECT DISTINCT ON (b.event_hash) b.block_id, e.copies
        FROM blocks b JOIN {_COPIES} e ON b.event_hash = e.h
        WHERE b.instance = :instance AND (b.engine_copies > 0 OR b.ref_count = 0)
        ORDER BY b.event_hash, b.ref_count > 0, b.engine_copies = 0, b.block_id
    )
    UPDATE blocks b SET engine_copies = greatest(b.engine_copies - p.copies, 0)
    FROM pick p
    WHERE b.instance = :instance AND b.block_id = p.block_id
    RETURNING b.block_id, b.engine_copies
    """
)

# After _REMOVED: the blocks whose last copy the engine evicted.
_REMOVE = text(
    blocks.drop_contents(
        "SELECT block_id, state, content_hash FROM blocks "
        "WHERE instance = :instance AND block_id = ANY (CAST(:dropped AS integer[]))",
        "ENGINE_EVICTED",
    )
)

_FORGET_COPIES = text(
    "UPDATE blocks SET engine_copies = 0, engine_confirmed_at = NULL "
    "WHERE instance = :instance AND (engine_copies > 0 OR engine_confirmed_at IS NOT NULL)"
)

_CLEAR = text(
    blocks.drop_contents(
        "SELECT block_id, state, content_hash FROM blocks "
        "WHERE instance = :instance AND state = 'CACHED'",
        "ENGINE_CLEARED",
    )
)

# In the driver's placeholders: an instance's owner commits them with the batch of events.
APPLIED = "UPDATE instances SET last_event_seq = %(seq)s WHERE instance = %(instance)s"
RESYNCED = (
    "UPDATE instances SET engine_resyncs = engine_resyncs + 1, last_event_seq = %(seq)s "
    "WHERE instance = %(instance)s"
)
_APPLIED = driver_statement(APPLIED)
_RESYNCED = driver_statement(RESYNCED)

_LIVE_ON_INSTANCE = text(
    "SELECT tenant, request_id FROM reservations WHERE instance = :instance AND state = 'ADMITTED'"
)


_FOLLOWED = text(
    "SELECT instance, kv_events_endpoint, kv_replay_endpoint, engine_url FROM instances "
    "WHERE kv_events_endpoint IS NOT NULL ORDER BY instance"
)

_LAST_APPLIED = text("SELECT last_event_seq FROM instances WHERE instance = :instance")

_ENGINE_RUNNING = text(
    "UPDATE instances SET engine_requests_running = :running, engine_checked_at = now() "
    "WHERE instance = :instance"
)


def signed(event_hash: int) -> int:
    """vLLM's unsigned 64-bit event hash as the bigint the blocks table keeps."""
    return event_hash - (1 << 64) if event_hash >= 1 << 63 else event_hash


class Reconciler:
    def __init__(self, engine: AsyncEngine, ledger: Ledger) -> None:
        self._engine = engine
        self._ledger = ledger

    async def followed_engines(self) -> list[tuple[str, str, str | None, str | None]]:
        """(instance, events endpoint, replay endpoint, engine URL) of every instance whose
        engine publishes KV events."""
        async with self._engine.connect() as conn:
            return [(i, e, r, u) for i, e, r, u in await conn.execute(_FOLLOWED)]

    async def last_applied(self, instance: str) -> int | None:
        """The sequence number of the last batch applied (-1: resynchronised from empty, None:
        never followed)."""
        async with self._engine.connect() as conn:
            seq = (await conn.execute(_LAST_APPLIED, {"instance": instance})).scalar_one_or_none()
            return None if seq is None else int(seq)

    async def apply(self, instance: str, seq: int, batch: EventBatch) -> tuple[int, int]:
        """Apply one batch in order, in one transaction; returns (blocks freed, drift seen)."""

        async def work(conn: AsyncConnection) -> tuple[int, int]:
            await conn.execute(blocks.LOCK_INSTANCE, {"instance": instance})
            freed = drift = 0
            for event in batch.events:
                if isinstance(event, AllBlocksCleared):
                    freed += await self._forget(conn, instance)
                elif event.medium != GPU:
                    continue
                elif isinstance(event, BlockStored):
                    await conn.execute(_STORED, self._hashes(instance, event.block_hashes))
                elif isinstance(event, BlockRemoved):
                    hashes = self._hashes(instance, event.block_hashes)
                    left = await conn.execute(_REMOVED, hashes)
                    dropped = [r.block_id for r in left if r.engine_copies == 0]
                    if dropped:
                        victims = {"instance": instance, "dropped": dropped}
                        row = (await conn.execute(_REMOVE, victims)).one()
                        freed, drift = freed + row.freed, drift + row.drift
            await conn.execute(_APPLIED, {"instance": instance, "seq": seq})
            return freed, drift

        return await in_transaction(self._engine, work)

    async def resynchronise(self, instance: str, seq: int, *, restarted: bool) -> int:
        """Forget what the engine held. After a restart the reservations that were running on it
        end first (their blocks come back), then every cached block is freed. Returns how many
        reservations ended."""
        lost: list[tuple[str, str]] = []
        if restarted:
            async with self._engine.connect() as conn:
                rows = await conn.execute(_LIVE_ON_INSTANCE, {"instance": instance})
                lost = [(r.tenant, r.request_id) for r in rows]
            for tenant, request_id in lost:
                await self._ledger.end(tenant, request_id, EndReason.ENGINE_RESTARTED)
            if lost:
                log.warning("engine of %s restarted: %d reservations ended", instance, len(lost))

        await self._forget_engine(instance, seq)
        return len(lost)

    async def _forget_engine(self, instance: str, seq: int) -> None:
        """The engine holds nothing any more, from batch `seq` on."""

        async def forget(conn: AsyncConnection) -> None:
            await conn.execute(blocks.LOCK_INSTANCE, {"instance": instance})
            await self._forget(conn, instance)
            await conn.execute(_RESYNCED, {"instance": instance, "seq": seq})

        await in_transaction(self._engine, forget)

    async def record_engine_load(self, instance: str, running: int) -> None:
        """What the engine says it runs, beside the ledger's live reservations (GetInstance)."""
        async with self._engine.begin() as conn:
            await conn.execute(_ENGINE_RUNNING, {"instance": instance, "running": running})

    @staticmethod
    async def _forget(conn: AsyncConnection, instance: str) -> int:
        """The engine holds nothing: no copies anywhere, and the cached blocks are freed.
        Returns how many were."""
        await conn.execute(_FORGET_COPIES, {"instance": instance})
        return int((await conn.execute(_CLEAR, {"instance": instance})).one().freed)

    @staticmethod
    def _hashes(instance: str, hashes: Sequence[int]) -> dict[str, object]:
        return {"instance": instance, "hashes": [signed(h) for h in hashes]}
