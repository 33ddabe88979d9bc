"""The invariants (core/invariants.py numbers them) checked over the record: each invariant the
record can show is one function of a few queries, each query selecting the rows that break it,
so an empty result everywhere means the record is consistent. They read the per-block tables
today; a view of the record can take their place one function at a time.

One read-only, repeatable-read transaction covers every check, so a check run under traffic
compares rows of one moment."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from sqlalchemy import TextClause, text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from quota_service.core.invariants import (
    DEFAULT_ROWS,
    INVARIANTS,
    InvariantReport,
    Offence,
    judged,
    not_checked,
)

SLOT_STATES = text("""
    SELECT i.instance, i.capacity_blocks AS capacity, coalesce(b.total, 0) AS slots,
           i.free_blocks || '/' || coalesce(b.free, 0) AS free,
           i.cached_blocks || '/' || coalesce(b.cached, 0) AS cached,
           i.blocks_in_use || '/' || coalesce(b.in_use, 0) AS in_use,
           i.pinned_blocks || '/' || coalesce(b.pinned, 0) AS pinned
    FROM instances i
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
    ORDER BY i.instance LIMIT :limit
""")

REFERENCE_COUNTS = text("""
    SELECT b.instance, b.block_id, b.generation, b.ref_count, coalesce(r.entries, 0) AS entries,
           b.pin_count, coalesce(r.pins, 0) AS pin_entries
    FROM blocks b
    LEFT JOIN (
        SELECT instance, block_id, generation, count(*) AS entries,
               count(*) FILTER (WHERE pinned) AS pins
        FROM block_refs WHERE NOT released GROUP BY instance, block_id, generation
    ) r ON r.instance = b.instance AND r.block_id = b.block_id AND r.generation = b.generation
    WHERE b.ref_count <> coalesce(r.entries, 0) OR b.pin_count <> coalesce(r.pins, 0)
       OR b.pin_count < 0 OR b.ref_count < b.pin_count
    ORDER BY b.instance, b.block_id LIMIT :limit
""")

ENTRIES_OF_ENDED_HOLDERS = text("""
    SELECT holder_id, position, instance, block_id FROM block_refs
    WHERE NOT released AND holder_id NOT IN (
        SELECT holder_id FROM reservations WHERE state = 'ADMITTED'
        UNION ALL SELECT holder_id FROM pins WHERE state = 'ACTIVE'
    )
    ORDER BY holder_id, position LIMIT :limit
""")

OFFLOADED_WITH_BLOCKS = text("""
    SELECT r.tenant, r.request_id, r.state FROM reservations r
    WHERE r.offloaded_bytes IS NOT NULL AND (
        (r.state = 'ADMITTED' AND r.suspended_at IS NULL)
        OR EXISTS (SELECT 1 FROM block_refs b WHERE b.holder_id = r.holder_id AND NOT b.released))
    ORDER BY r.tenant, r.request_id LIMIT :limit
""")

TENANT_COUNTERS = text("""
    SELECT t.tenant,
           t.blocks_in_use || '/' || coalesce(tb.blocks, 0) || '/' || coalesce(r.blocks, 0)
               AS blocks,
           t.pinned_blocks || '/' || coalesce(tb.pinned, 0) AS pinned,
           t.tokens_in_flight || '/' || coalesce(v.tokens, 0) AS tokens_in_flight
    FROM tenants t
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
    ORDER BY t.tenant LIMIT :limit
""")

TENANT_BLOCK_REFERENCES = text("""
    SELECT tb.tenant, tb.instance, tb.block_id, tb.refs, coalesce(r.refs, 0) AS entries,
           tb.pin_refs, coalesce(r.pins, 0) AS pin_entries
    FROM tenant_blocks tb
    LEFT JOIN (SELECT tenant, instance, block_id, generation, count(*) AS refs,
                      count(*) FILTER (WHERE pinned) AS pins
               FROM block_refs WHERE NOT released AND tenant IS NOT NULL
               GROUP BY tenant, instance, block_id, generation) r
      ON r.tenant = tb.tenant AND r.instance = tb.instance AND r.block_id = tb.block_id
     AND r.generation = tb.generation
    WHERE tb.refs <> coalesce(r.refs, 0) OR tb.pin_refs <> coalesce(r.pins, 0)
    ORDER BY tb.tenant, tb.instance, tb.block_id LIMIT :limit
""")

QUEUE_COUNTERS = text("""
    SELECT * FROM (
        SELECT 'instances/' || i.instance AS name,
               i.queued_requests || '/' || coalesce(q.n, 0) AS queued,
               i.queued_prompt_tokens || '/' || coalesce(q.tokens, 0) AS prompt_tokens
        FROM instances i
        LEFT JOIN (SELECT instance, count(*) AS n, sum(prompt_tokens) AS tokens
                   FROM reservations WHERE state = 'QUEUED' GROUP BY instance) q USING (instance)
        WHERE i.queued_requests <> coalesce(q.n, 0)
           OR i.queued_prompt_tokens <> coalesce(q.tokens, 0)
        UNION ALL
        SELECT 'tenants/' || t.tenant, t.queued_requests || '/' || coalesce(q.n, 0), '-'
        FROM tenants t
        LEFT JOIN (SELECT tenant, count(*) AS n FROM reservations WHERE state = 'QUEUED'
                   GROUP BY tenant) q USING (tenant)
        WHERE t.queued_requests <> coalesce(q.n, 0)
    ) counters
    ORDER BY name LIMIT :limit
""")

STALE_ENTRIES = text("""
    SELECT r.holder_id, r.position, r.instance, r.block_id, r.generation,
           b.generation AS current_generation, s.reason AS tombstone
    FROM block_refs r
    JOIN blocks b ON b.instance = r.instance AND b.block_id = r.block_id
    LEFT JOIN tombstones s ON s.instance = r.instance AND s.block_id = r.block_id
     AND s.generation = r.generation
    WHERE NOT r.released AND (r.generation <> b.generation OR s.block_id IS NOT NULL)
    ORDER BY r.holder_id, r.position LIMIT :limit
""")

FREED_WITH_SCOPE = text("""
    SELECT instance, block_id, generation, hash_scope FROM blocks
    WHERE ref_count = 0 AND content_hash IS NULL AND hash_scope IS NOT NULL
    ORDER BY instance, block_id LIMIT :limit
""")

TOMBSTONED_CURRENT_HANDLES = text("""
    SELECT b.instance, b.block_id, b.generation, s.reason FROM blocks b
    JOIN tombstones s ON s.instance = b.instance AND s.block_id = b.block_id
     AND s.generation = b.generation
    ORDER BY b.instance, b.block_id LIMIT :limit
""")

COPIES_WITHOUT_CONTENTS = text("""
    SELECT instance, block_id, generation, engine_copies FROM blocks
    WHERE content_hash IS NULL AND (engine_copies <> 0 OR engine_confirmed_at IS NOT NULL)
    ORDER BY instance, block_id LIMIT :limit
""")

# Names only: a salt is a secret.
SHARED_SALTS = text("""
    SELECT string_agg(owner, ', ' ORDER BY owner) AS sharing_one_salt FROM (
        SELECT 'tenants/' || tenant AS owner, cache_salt FROM tenants
        UNION ALL SELECT 'namespaces/' || namespace, cache_salt FROM namespaces
    ) salts
    GROUP BY cache_salt HAVING count(*) > 1
    ORDER BY 1 LIMIT :limit
""")

PINS_MISSING_BLOCKS = text("""
    SELECT p.owner, p.pin_id, p.instance, p.pinned_blocks, count(r.position) AS entries
    FROM pins p
    LEFT JOIN block_refs r ON r.holder_id = p.holder_id AND NOT r.released
    WHERE p.state = 'ACTIVE'
    GROUP BY p.holder_id, p.owner, p.pin_id, p.instance, p.pinned_blocks
    HAVING count(r.position) <> p.pinned_blocks
    ORDER BY p.owner, p.pin_id LIMIT :limit
""")

NEITHER_LIVE_NOR_ENDED = text("""
    SELECT tenant, request_id, state, lease_expires_at, ended_at, end_reason FROM reservations
    WHERE state NOT IN ('QUEUED', 'ADMITTED', 'ENDED')
       OR (state = 'ENDED' AND (ended_at IS NULL OR end_reason IS NULL))
       OR (state <> 'ENDED' AND (ended_at IS NOT NULL OR end_reason IS NOT NULL))
       OR (state = 'ADMITTED' AND (admitted_at IS NULL OR lease_expires_at IS NULL))
    ORDER BY tenant, request_id LIMIT :limit
""")


async def _offences(
    conn: AsyncConnection, limit: int, checks: dict[str, TextClause]
) -> list[Offence]:
    """The checks that found rows: one more row than shown is read, to say that there are more."""
    found = []
    for check, query in checks.items():
        result = await conn.execute(query, {"limit": limit + 1})
        rows = [tuple(row) for row in result.all()]
        if rows:
            columns = tuple(result.keys())
            found.append(Offence(check, columns, tuple(rows[:limit]), len(rows) > limit))
    return found


async def slot_states(conn: AsyncConnection, limit: int) -> list[Offence]:
    checks = {
        "an instance's counters (recorded/counted) match its slots, one per block": SLOT_STATES
    }
    return await _offences(conn, limit, checks)


async def reference_counts(conn: AsyncConnection, limit: int) -> list[Offence]:
    checks = {
        "a block's references and pins = the live entries naming its current handle": (
            REFERENCE_COUNTS
        ),
        "only admitted reservations and active pins hold entries": ENTRIES_OF_ENDED_HOLDERS,
        "a session offloaded to the CPU tier is suspended and holds no entries": (
            OFFLOADED_WITH_BLOCKS
        ),
    }
    return await _offences(conn, limit, checks)


async def tenant_holdings(conn: AsyncConnection, limit: int) -> list[Offence]:
    checks = {
        "a tenant's blocks (recorded/held/referenced), pins and tokens in flight match": (
            TENANT_COUNTERS
        ),
        "a tenant's references to a block = its live entries naming it": TENANT_BLOCK_REFERENCES,
        "queued requests (recorded/counted) = the queued reservations": QUEUE_COUNTERS,
    }
    return await _offences(conn, limit, checks)


async def handles(conn: AsyncConnection, limit: int) -> list[Offence]:
    checks = {
        "no live entry names a tombstoned or outdated handle": STALE_ENTRIES,
        "a freed block keeps no contents a prefix lookup could return": FREED_WITH_SCOPE,
        "a block's current handle is never tombstoned": TOMBSTONED_CURRENT_HANDLES,
        "a block without contents holds no copy the engine reported": COPIES_WITHOUT_CONTENTS,
        "no two tenants or namespaces share a cache salt": SHARED_SALTS,
    }
    return await _offences(conn, limit, checks)


async def pinned_blocks(conn: AsyncConnection, limit: int) -> list[Offence]:
    checks = {"an active pin holds every block of its prefix": PINS_MISSING_BLOCKS}
    return await _offences(conn, limit, checks)


async def live_or_ended(conn: AsyncConnection, limit: int) -> list[Offence]:
    checks = {
        "a reservation is queued, admitted with a lease, or ended with a time and a reason": (
            NEITHER_LIVE_NOR_ENDED
        )
    }
    return await _offences(conn, limit, checks)


RecordCheck = Callable[[AsyncConnection, int], Awaitable[list[Offence]]]

# Each invariant the record shows: what of it the checks cover, and the check.
CHECKED: dict[int, tuple[str, RecordCheck]] = {
    1: ("each instance's counters against its slot rows", slot_states),
    2: (
        "every slot's counts against the live entries and pins naming it; entries of live "
        "holders only",
        reference_counts,
    ),
    3: (
        "each tenant's counters against its live entries, reservations and queue (within "
        "quota at admission: the admission tests)",
        tenant_holdings,
    ),
    4: (
        "live entries against current handles and tombstones, freed slots, salts (the hashes "
        "themselves: the hashing tests)",
        handles,
    ),
    6: (
        "each active pin holds its whole prefix (what a reclaim plan counts: the planner's tests)",
        pinned_blocks,
    ),
    7: (
        "the record's half; the crash half is `make stress`'s, which checks after every fault",
        live_or_ended,
    ),
}

NOT_CHECKED = {
    5: "a property of repeated calls, not of a record: the ledger's and the model's tests "
    "repeat them",
    8: "instances are served from the record itself: there is no owner's memory or epoch to "
    "compare yet",
}


async def check_record(engine: AsyncEngine, limit: int = DEFAULT_ROWS) -> list[InvariantReport]:
    """Every invariant in order: judged from the record, or not checked and why."""
    reports = []
    async with engine.connect() as conn:
        await conn.execution_options(isolation_level="REPEATABLE READ", postgresql_readonly=True)
        for number in INVARIANTS:
            if number in NOT_CHECKED:
                reports.append(not_checked(number, NOT_CHECKED[number]))
            else:
                scope, check = CHECKED[number]
                reports.append(judged(number, scope, await check(conn, limit)))
    return reports
