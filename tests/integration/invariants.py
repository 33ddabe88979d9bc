"""DESIGN.md's invariants 1-4 and 6, as SQL over the whole ledger. Each query returns the rows
that break its invariant; an empty result everywhere means the ledger is consistent."""

from __future__ import annotations

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

LIVE_HOLDERS = """
    SELECT holder_id FROM reservations WHERE state = 'ADMITTED'
    UNION ALL SELECT holder_id FROM pins WHERE state = 'ACTIVE'
"""

CHECKS = {
    "1: every slot in one state, counters match, they add up to capacity": """
        SELECT i.instance FROM instances i
        LEFT JOIN (
            SELECT instance, count(*) AS total,
                   count(*) FILTER (WHERE state = 'FREE') AS free,
                   count(*) FILTER (WHERE state = 'CACHED') AS cached,
                   count(*) FILTER (WHERE state = 'IN_USE') AS in_use,
                   count(*) FILTER (WHERE state = 'PINNED') AS pinned
            FROM blocks GROUP BY instance
        ) b USING (instance)
        WHERE coalesce(b.total, 0) <> i.capacity_blocks
           OR coalesce(b.free, 0) <> i.free_blocks OR coalesce(b.cached, 0) <> i.cached_blocks
           OR coalesce(b.in_use, 0) <> i.blocks_in_use OR coalesce(b.pinned, 0) <> i.pinned_blocks
    """,
    "2: ref_count = live entries naming the current handle (pins included), never negative": """
        SELECT b.instance, b.block_id, b.ref_count, b.pin_count, r.entries, r.pins FROM blocks b
        LEFT JOIN (
            SELECT instance, block_id, generation, count(*) AS entries,
                   count(*) FILTER (WHERE pinned) AS pins
            FROM block_refs WHERE NOT released GROUP BY instance, block_id, generation
        ) r ON r.instance = b.instance AND r.block_id = b.block_id
           AND r.generation = b.generation
        WHERE b.ref_count <> coalesce(r.entries, 0) OR b.pin_count <> coalesce(r.pins, 0)
           OR b.pin_count < 0 OR b.ref_count < b.pin_count
    """,
    "2: only live reservations and active pins hold entries": f"""
        SELECT holder_id, position FROM block_refs
        WHERE NOT released AND holder_id NOT IN ({LIVE_HOLDERS})
    """,
    "3: a tenant's blocks = distinct handles its live entries reference; pins; tokens": """
        SELECT t.tenant FROM tenants t
        LEFT JOIN (SELECT tenant, count(*) AS blocks, count(*) FILTER (WHERE pin_refs > 0) AS pinned
                   FROM tenant_blocks GROUP BY tenant) tb USING (tenant)
        LEFT JOIN (SELECT tenant, count(DISTINCT (instance, block_id)) AS blocks
                   FROM block_refs WHERE NOT released AND tenant IS NOT NULL
                   GROUP BY tenant) r USING (tenant)
        LEFT JOIN (SELECT tenant, sum(reserved_tokens) AS tokens FROM reservations
                   WHERE state = 'ADMITTED' AND offloaded_bytes IS NULL
                   GROUP BY tenant) v USING (tenant)
        WHERE t.blocks_in_use <> coalesce(tb.blocks, 0) OR t.blocks_in_use <> coalesce(r.blocks, 0)
           OR t.pinned_blocks <> coalesce(tb.pinned, 0)
           OR t.tokens_in_flight <> coalesce(v.tokens, 0)
    """,
    "3: per-tenant reference counts match the entries": """
        SELECT tb.tenant, tb.block_id FROM tenant_blocks tb
        LEFT JOIN (SELECT tenant, instance, block_id, generation, count(*) AS refs,
                          count(*) FILTER (WHERE pinned) AS pins
                   FROM block_refs WHERE NOT released AND tenant IS NOT NULL
                   GROUP BY tenant, instance, block_id, generation) r
          ON r.tenant = tb.tenant AND r.instance = tb.instance AND r.block_id = tb.block_id
         AND r.generation = tb.generation
        WHERE tb.refs <> coalesce(r.refs, 0) OR tb.pin_refs <> coalesce(r.pins, 0)
    """,
    "an offloaded reservation is suspended (or queued to resume) with no block table": """
        SELECT r.request_id FROM reservations r
        WHERE r.offloaded_bytes IS NOT NULL AND (
            (r.state = 'ADMITTED' AND r.suspended_at IS NULL)
            OR EXISTS (SELECT 1 FROM block_refs b
                       WHERE b.holder_id = r.holder_id AND NOT b.released))
    """,
    "queue counters match the queued reservations": """
        SELECT i.instance FROM instances i
        LEFT JOIN (SELECT instance, count(*) AS n, sum(prompt_tokens) AS tokens
                   FROM reservations WHERE state = 'QUEUED' GROUP BY instance) q USING (instance)
        WHERE i.queued_requests <> coalesce(q.n, 0)
           OR i.queued_prompt_tokens <> coalesce(q.tokens, 0)
        UNION ALL
        SELECT t.tenant FROM tenants t
        LEFT JOIN (SELECT tenant, count(*) AS n FROM reservations WHERE state = 'QUEUED'
                   GROUP BY tenant) q USING (tenant)
        WHERE t.queued_requests <> coalesce(q.n, 0)
    """,
    "4: no live entry names a tombstoned or outdated handle": """
        SELECT r.holder_id, r.position FROM block_refs r
        JOIN blocks b ON b.instance = r.instance AND b.block_id = r.block_id
        LEFT JOIN tombstones s ON s.instance = r.instance AND s.block_id = r.block_id
         AND s.generation = r.generation
        WHERE NOT r.released AND (r.generation <> b.generation OR s.block_id IS NOT NULL)
    """,
    "4: a freed block keeps no contents a prefix lookup could return": """
        SELECT instance, block_id FROM blocks
        WHERE ref_count = 0 AND content_hash IS NULL AND hash_scope IS NOT NULL
    """,
    "4: a block's current handle is never tombstoned": """
        SELECT b.instance, b.block_id FROM blocks b
        JOIN tombstones s ON s.instance = b.instance AND s.block_id = b.block_id
         AND s.generation = b.generation
    """,
    "engine copies: a block without contents holds no copy the engine reported": """
        SELECT instance, block_id FROM blocks
        WHERE content_hash IS NULL AND (engine_copies <> 0 OR engine_confirmed_at IS NOT NULL)
    """,
    "6: an active pin holds every block of its prefix": """
        SELECT p.holder_id FROM pins p
        LEFT JOIN block_refs r ON r.holder_id = p.holder_id AND NOT r.released
        WHERE p.state = 'ACTIVE'
        GROUP BY p.holder_id, p.pinned_blocks HAVING count(r.position) <> p.pinned_blocks
    """,
}


async def violations(engine: AsyncEngine) -> list[str]:
    found = []
    async with engine.connect() as conn:
        for invariant, query in CHECKS.items():
            rows = (await conn.execute(text(query))).all()
            if rows:
                found.append(f"invariant {invariant}: {rows[:5]}")
    return found


async def assert_invariants(engine: AsyncEngine) -> None:
    broken = await violations(engine)
    assert not broken, "\n".join(broken)
