"""The prefix lookup's cost does not grow with what the instance and the tenant already hold,
even when the planner's statistics are stale: it visits rows in proportion to the request's
hashes. (Left to stale statistics, it once scanned every hashed block of the instance and every
block the tenant held, once per hit.)"""

from __future__ import annotations

import json
from typing import Any

from sqlalchemy import TextClause, text
from sqlalchemy.ext.asyncio import AsyncEngine

from quota_service.config import Settings
from quota_service.core.admission import AdmitRequest
from quota_service.core.model import AdmitParams
from quota_service.store import blocks
from quota_service.store.ledger import Ledger
from tests.integration.ledger_fixtures import add_instance, add_tenant

HELD = 30  # reservations of 96 blocks (80 of them hashed prompt blocks) the tenant holds
PROMPT, OUTPUT = 1280, 256


def admit_request(request_id: str, first_token: int) -> AdmitRequest:
    tokens = tuple(range(first_token, first_token + PROMPT))
    return AdmitRequest(
        AdmitParams("acme", request_id, "gpu-0", PROMPT, OUTPUT, 1, 0), tokens, 0.0, None
    )


def rows_visited(plan: dict[str, Any]) -> int:
    """Rows every node of the plan produced or threw away by a filter, over all its loops."""
    loops = plan.get("Actual Loops", 1)
    per_loop = plan.get("Actual Rows", 0) + sum(
        plan.get(key, 0)
        for key in (
            "Rows Removed by Filter",
            "Rows Removed by Join Filter",
            "Rows Removed by Index Recheck",
        )
    )
    return int(per_loop * loops) + sum(rows_visited(p) for p in plan.get("Plans", []))


async def explained(engine: AsyncEngine, statement: TextClause, params: dict[str, Any]) -> int:
    """Rows the statement visits, run under EXPLAIN ANALYZE and rolled back."""
    async with engine.connect() as conn, conn.begin() as transaction:
        explain = text("EXPLAIN (ANALYZE, FORMAT JSON) " + statement.text)
        document = (await conn.execute(explain, params)).scalar_one()
        await transaction.rollback()
    plan = (document if isinstance(document, list) else json.loads(document))[0]["Plan"]
    return rows_visited(plan)


async def test_the_prefix_lookup_visits_rows_in_proportion_to_the_request(
    engine: AsyncEngine, settings: Settings
) -> None:
    await add_instance(engine, blocks=4096)
    await add_tenant(engine, "acme")
    async with engine.begin() as conn:
        for table in ("blocks", "block_refs", "tenant_blocks"):
            await conn.execute(text(f"ALTER TABLE {table} SET (autovacuum_enabled = false)"))
    book = Ledger(engine, settings.admission_limits)
    await book.admit(admit_request("held-0", 0))
    async with engine.begin() as conn:
        # Statistics of a young instance (one reservation); then it grows thirty-fold.
        await conn.execute(text("ANALYZE blocks, block_refs, tenant_blocks"))
    for i in range(1, HELD):
        await book.admit(admit_request(f"held-{i}", 10_000 * i))
    async with engine.connect() as conn:
        hashes = (
            await conn.execute(
                text(
                    "SELECT array_agg(b.content_hash) FROM reservations r "
                    "JOIN block_refs e ON e.holder_id = r.holder_id "
                    "JOIN blocks b ON b.instance = e.instance AND b.block_id = e.block_id "
                    "WHERE r.request_id = 'held-0' AND b.content_hash IS NOT NULL"
                )
            )
        ).scalar_one()
    assert len(hashes) == 80

    lookup = {"instance": "gpu-0", "tenant": "acme", "hashes": hashes}
    visited = await explained(engine, text(blocks.PREFIX_LOOKUP), lookup)
    # A probe per hash and per hit (80 each, plus their sort): not the 2,400 hashed blocks of
    # the pool, nor 80 times the tenant's 2,880 blocks.
    assert visited < 10 * len(hashes)
