"""How PostgreSQL runs a batch's statements as the journal prepares them (generic plans): a
batch must read only the rows of its own tenants, however many tenants the fleet has. Joined
with the batch's JSON rows alone (which PostgreSQL estimates at 100), the tenants' rows were
read whole in every batch: with 3,000 tenants, a one-operation batch cost twice its CPU."""

from __future__ import annotations

import psycopg

from quota_service.store.journal import BatchRows, _Batch, _Writer

TENANTS = 5_000


async def test_a_batch_moves_its_tenants_totals_by_their_key(database_url: str) -> None:
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        await conn.execute(
            "INSERT INTO tenants (tenant, max_blocks, max_tokens_in_flight, max_queued_requests, "
            "max_pinned_blocks, max_cpu_tier_bytes, cache_salt) "
            "SELECT 't' || g, 1000, 1000, 0, 0, 0, 's' FROM generate_series(1, %s) g",
            (TENANTS,),
        )
        await conn.execute("ANALYZE tenants")
        moved = {"blocks": 96, "tokens": 1536, "pinned": 0, "queued": 0}
        rows = BatchRows(
            totals=[{"tenant": "t1", **moved}, {"tenant": "t2", **moved}],
            pool={
                "instance": "gpu-0",
                "free": 0,
                "cached": 0,
                "in_use": 0,
                "pinned": 0,
                "queued": 0,
                "queued_tokens": 0,
                "mean_hold": None,
                "drift": 0,
            },
        )
        writer = _Writer(conn)
        await conn.execute("SET plan_cache_mode = force_generic_plan")
        plans = []
        for sql, params in _Batch("gpu-0", 1, rows).totals_moved():
            for prepare in writer.prepare([sql]):
                await conn.execute(prepare)
            execute = writer.cursor.mogrify(writer.executes[sql], params)
            cursor = await conn.execute(f"EXPLAIN {execute}")
            plans.append("\n".join(str(line) for (line,) in await cursor.fetchall()))
    assert len(plans) == 2  # the tenants' lock, then their totals moved
    for plan in plans:
        assert "Index Cond: ((tenant)::text = ANY" in plan, plan
        assert "Seq Scan on tenants" not in plan, plan
