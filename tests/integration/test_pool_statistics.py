"""The block tables' statistics: a registered pool is planned with its slots counted at once, not
after autovacuum's next pass (planned with no statistics, joins scan the whole pool), and the
tables that every Admit and Release rewrites are vacuumed and analyzed sooner than by default."""

from __future__ import annotations

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from tests.integration.ledger_fixtures import add_instance


async def test_a_registered_pool_has_statistics_at_once(engine: AsyncEngine) -> None:
    await add_instance(engine, "big", blocks=20_000)
    async with engine.connect() as conn:
        estimated = await conn.execute(
            text("SELECT reltuples FROM pg_class WHERE relname = 'blocks'")
        )
        assert estimated.scalar_one() >= 20_000


async def test_the_block_tables_are_vacuumed_and_analyzed_sooner(engine: AsyncEngine) -> None:
    async with engine.connect() as conn:
        options = await conn.execute(
            text(
                "SELECT relname, reloptions FROM pg_class "
                "WHERE relname IN ('blocks', 'block_refs', 'tenant_blocks')"
            )
        )
        found = {name: set(settings or ()) for name, settings in options}
    expected = {"autovacuum_vacuum_scale_factor=0.02", "autovacuum_analyze_scale_factor=0.02"}
    assert found == dict.fromkeys(("blocks", "block_refs", "tenant_blocks"), expected)
