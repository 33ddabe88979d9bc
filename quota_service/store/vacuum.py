"""Vacuuming the tables every Admit and Release rewrites. A pair leaves about 400 dead rows
(96 blocks updated twice, 96 entries and 96 holdings inserted and deleted), so a busy instance
makes tens of thousands a second: faster than autovacuum, which looks at a database once a minute
by default (and may be off), cleans up. Left alone, the dead index entries make every Admit step
over them, and a pair's cost grew fourfold in a minute of load (docs/benchmarks.md)."""

from __future__ import annotations

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

CHURNED_TABLES = ("blocks", "block_refs", "tenant_blocks", "reservations")

# A table is vacuumed once its dead rows pass both the given floor and this share of its live
# ones (a vacuum reads every index of the table whole, so a big pool is vacuumed less often).
DEAD_SHARE_OF_LIVE = 0.2

_DEAD_ROWS = text(
    """
    SELECT relname, n_live_tup, n_dead_tup FROM pg_stat_user_tables
    WHERE schemaname = current_schema() AND relname = ANY (CAST(:tables AS text[]))
    ORDER BY relname
    """
)


async def vacuum_churned(engine: AsyncEngine, min_dead_rows: int) -> int:
    """VACUUM (and ANALYZE) each churned table with enough dead rows; returns how many were.
    SKIP_LOCKED: a table another replica (or autovacuum) is vacuuming is left to it."""
    async with engine.connect() as conn:
        counts = (await conn.execute(_DEAD_ROWS, {"tables": list(CHURNED_TABLES)})).all()
    due = [
        name
        for name, live, dead in counts
        if dead > max(min_dead_rows, DEAD_SHARE_OF_LIVE * live) and name in CHURNED_TABLES
    ]
    if due:
        async with engine.connect() as conn:
            autocommit = await conn.execution_options(isolation_level="AUTOCOMMIT")
            for table in due:
                await autocommit.exec_driver_sql(f"VACUUM (ANALYZE, SKIP_LOCKED) {table}")
    return len(due)
