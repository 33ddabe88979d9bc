"""The maintenance sweep vacuums the block tables once Admits and Releases have left enough dead
rows in them, whether or not autovacuum runs."""

from __future__ import annotations

import asyncio

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from quota_service.config import Settings
from quota_service.core.model import EndReason
from quota_service.store.ledger import Ledger
from quota_service.store.vacuum import vacuum_churned
from tests.integration.invariants import assert_invariants
from tests.integration.ledger_fixtures import add_instance, add_tenant, request

FLOOR = 200  # dead rows a table must have (above a fifth of its live ones)

_DEAD = text(
    "SELECT relname, n_dead_tup FROM pg_stat_user_tables "
    "WHERE relname IN ('blocks', 'block_refs', 'tenant_blocks') ORDER BY relname"
)


async def dead_rows(engine: AsyncEngine) -> dict[str, int]:
    async with engine.connect() as conn:
        return {name: dead for name, dead in await conn.execute(_DEAD)}


async def test_churned_tables_are_vacuumed_past_the_threshold(
    engine: AsyncEngine, settings: Settings
) -> None:
    await add_instance(engine, blocks=512)
    await add_tenant(engine, "acme")
    book = Ledger(engine, settings.admission_limits)
    # Nothing is dead yet; the new pool's rows may be analyzed, if their count was reported.
    assert await vacuum_churned(engine, FLOOR) <= 1
    for i in range(10):
        await book.admit(request(f"r{i}", 1000, 24))  # 64 blocks
        await book.end("acme", f"r{i}", EndReason.RELEASED, 1)
    # Backends report their counts within a second or so of going idle.
    for _ in range(100):
        if min((await dead_rows(engine)).values()) > FLOOR:
            break
        await asyncio.sleep(0.2)
    assert min((await dead_rows(engine)).values()) > FLOOR

    assert await vacuum_churned(engine, FLOOR) >= 3
    assert all(dead < FLOOR for dead in (await dead_rows(engine)).values())
    assert await vacuum_churned(engine, FLOOR) == 0  # until they churn again
    await assert_invariants(engine)


_ANALYZED = text(
    "SELECT relname, n_mod_since_analyze FROM pg_stat_user_tables "
    "WHERE relname IN ('block_refs', 'tenant_blocks') ORDER BY relname"
)
_LIVE = text(
    "SELECT min(n_live_tup) FROM pg_stat_user_tables "
    "WHERE relname IN ('block_refs', 'tenant_blocks')"
)


async def test_tables_filled_without_dying_are_analyzed(
    engine: AsyncEngine, settings: Settings
) -> None:
    """Admissions alone insert block-table entries and holdings (nothing dead): once the tables
    hold far more rows than their statistics say, they are analyzed."""
    await add_instance(engine, blocks=1024)
    await add_tenant(engine, "acme")
    book = Ledger(engine, settings.admission_limits)
    for i in range(10):
        await book.admit(request(f"r{i}", 1000, 24))  # 64 entries and 64 holdings each

    async def changed() -> dict[str, int]:
        async with engine.connect() as conn:
            return {name: mods for name, mods in await conn.execute(_ANALYZED)}

    for _ in range(100):
        async with engine.connect() as conn:
            if (await conn.execute(_LIVE)).scalar_one() > FLOOR:
                break
        await asyncio.sleep(0.2)
    assert min((await changed()).values()) > FLOOR
    assert await vacuum_churned(engine, FLOOR) >= 2
    for _ in range(100):  # the analyze's own report follows a moment later
        if max((await changed()).values()) < FLOOR:
            break
        await asyncio.sleep(0.2)
    assert max((await changed()).values()) < FLOOR
    await assert_invariants(engine)
