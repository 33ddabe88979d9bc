"""Vacuuming the tables every Admit and Release rewrites. A pair leaves about 400 dead rows
(96 blocks updated twice, 96 entries and 96 holdings inserted and deleted), so a busy instance
makes tens of thousands a second: faster than autovacuum, which looks at a database once a minute
by default (and may be off), cleans up. Left alone, the dead index entries make every Admit step
over them, and a pair's cost grew fourfold in a minute of load (docs/benchmarks.md).

A table whose size moved far from what its statistics say (filled again after a mass release)
is analyzed: its statistics would otherwise be those taken when it was nearly empty, and
PostgreSQL keeps that density as the table refills its pages. (Steady churn keeps the size: the
vacuums' own analyzes are enough then.) Offboarding a tenant after such a refill was planned as
one scan of block_refs per reservation: 7 s instead of 2.3 s for 100,000 blocks."""

from __future__ import annotations

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

CHURNED_TABLES = ("blocks", "block_refs", "tenant_blocks", "reservations")

# A table is vacuumed once its dead rows pass both the given floor and this share of its live
# ones (a vacuum reads every index of the table whole, so a big pool is vacuumed less often).
DEAD_SHARE_OF_LIVE = 0.2

# Live and dead rows now, and the rows the statistics were taken with (-1: never).
_DEAD_ROWS = text(
    """
    SELECT s.relname, s.n_live_tup, s.n_dead_tup, greatest(c.reltuples, 0)::bigint AS analyzed
    FROM pg_stat_user_tables s JOIN pg_class c ON c.oid = s.relid
    WHERE s.schemaname = current_schema() AND s.relname = ANY (CAST(:tables AS text[]))
    ORDER BY s.relname
    """
)


async def vacuum_churned(engine: AsyncEngine, min_dead_rows: int) -> int:
    """VACUUM (and ANALYZE) each churned table with enough dead rows, and ANALYZE one whose
    live rows moved as far from its statistics; returns how many tables were. SKIP_LOCKED: a
    table another replica (or autovacuum) is working on is left to it."""
    async with engine.connect() as conn:
        counts = (await conn.execute(_DEAD_ROWS, {"tables": list(CHURNED_TABLES)})).all()
    work: list[str] = []
    for name, live, dead, analyzed in counts:
        floor = max(min_dead_rows, DEAD_SHARE_OF_LIVE * live)
        if name not in CHURNED_TABLES:  # never in a statement unless it is one of ours
            continue
        if dead > floor:
            work.append(f"VACUUM (ANALYZE, SKIP_LOCKED) {name}")
        elif abs(live - analyzed) > max(min_dead_rows, DEAD_SHARE_OF_LIVE * analyzed):
            work.append(f"ANALYZE (SKIP_LOCKED) {name}")
    if work:
        async with engine.connect() as conn:
            autocommit = await conn.execution_options(isolation_level="AUTOCOMMIT")
            for statement in work:
                await autocommit.exec_driver_sql(statement)
    return len(work)
