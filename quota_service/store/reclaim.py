"""What a reclaim plan starts from: one consistent snapshot of an instance's pool, read in a
single repeatable-read transaction so the cached blocks, block tables and pins agree."""

from __future__ import annotations

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from quota_service.core.reclaim import HeldBlock, LiveReservation, PoolSnapshot, UnreferencedBlock
from quota_service.store.catalog import Catalog

_CACHED = text(
    "SELECT block_id, generation, lru_seq, hash_scope FROM blocks "
    "WHERE instance = :instance AND state = 'CACHED' ORDER BY lru_seq"
)

# Each admitted reservation with its live block table, and per entry the block's total
# references and whether a pin holds it.
_LIVE = text(
    """
    SELECT r.tenant, r.request_id, r.priority,
           row_number() OVER (ORDER BY r.admitted_at, r.holder_id) AS admitted_seq,
           array_agg(ref.block_id ORDER BY ref.position) AS block_ids,
           array_agg(ref.generation ORDER BY ref.position) AS generations,
           array_agg(b.ref_count ORDER BY ref.position) AS ref_counts,
           array_agg(b.pin_count > 0 ORDER BY ref.position) AS pinned
    FROM reservations r
    JOIN block_refs ref ON ref.holder_id = r.holder_id AND NOT ref.released
    JOIN blocks b ON b.instance = ref.instance AND b.block_id = ref.block_id
    WHERE r.instance = :instance AND r.state = 'ADMITTED'
    GROUP BY r.tenant, r.request_id, r.priority, r.admitted_at, r.holder_id
    ORDER BY admitted_seq
    """
)

# A scope is active while one of its tenants has a reservation live on the instance.
_ACTIVE_SCOPES = text(
    """
    SELECT DISTINCT unnest(ARRAY['tenants/' || t.tenant, 'namespaces/' || t.namespace])
    FROM reservations r JOIN tenants t USING (tenant)
    WHERE r.instance = :instance AND r.state = 'ADMITTED'
    """
)

# Blocks only pins hold, by whose salt hashed them (each block counted once).
_PINNED_ONLY = text(
    "SELECT hash_scope, count(*) FROM blocks WHERE instance = :instance AND state = 'PINNED' "
    "GROUP BY hash_scope ORDER BY hash_scope"
)


async def load_snapshot(engine: AsyncEngine, instance: str) -> PoolSnapshot:
    """The instance's pool as the planner sees it. No reservation is suspended and no instance
    has a CPU tier until SuspendReservation and the LMCache driver exist."""
    # An instance's geometry never changes, so it is read apart (NOT_FOUND for no instance).
    bytes_per_block = (await Catalog(engine).get_instance(instance)).spec.bytes_per_block or 0
    args = {"instance": instance}
    async with engine.connect() as conn:
        await conn.execution_options(isolation_level="REPEATABLE READ")
        cached = tuple(
            UnreferencedBlock(r.block_id, r.generation, r.lru_seq, r.hash_scope)
            for r in await conn.execute(_CACHED, args)
        )
        reservations = tuple(
            LiveReservation(
                r.tenant,
                r.request_id,
                r.priority,
                r.admitted_seq,
                False,
                tuple(
                    HeldBlock(*entry)
                    for entry in zip(
                        r.block_ids, r.generations, r.ref_counts, r.pinned, strict=True
                    )
                ),
            )
            for r in await conn.execute(_LIVE, args)
        )
        active = frozenset(s for (s,) in await conn.execute(_ACTIVE_SCOPES, args) if s)
        pinned = tuple((scope, n) for scope, n in await conn.execute(_PINNED_ONLY, args))
        await conn.rollback()
    return PoolSnapshot(bytes_per_block, cached, reservations, active, pinned, None)
