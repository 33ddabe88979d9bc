"""A registered pool is planned with its slots counted at once, not after autovacuum's next pass:
planned with no statistics, the hot path's joins scan the whole pool."""

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
