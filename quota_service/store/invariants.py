"""The invariants (core/invariants.py numbers them) checked over the record: reservation and pin
rows with block arrays, pool checkpoints and deltas, read through the journal's views (migration
0021) into one shape: the live entries of every table and pin, the current generation of every
slot holding contents, counters beside what they count. Counters are judged in
core/invariants.py; each other check is a query selecting the rows that break it, so an empty
result everywhere means the record is consistent.

One read-only, repeatable-read transaction covers every check, so a check run under traffic
compares rows of one moment; its queries go in one round trip."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import psycopg
from sqlalchemy import TextClause, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine

from quota_service.core.invariants import (
    DEFAULT_ROWS,
    INVARIANTS,
    InvariantReport,
    Offence,
    Tally,
    judged,
    not_checked,
    offence,
    pool_tally,
    tally_offences,
)

# Every live entry of a block table or a pin (the view holds admitted reservations' and active
# pins' entries only), its holder by name.
_LIVE_ENTRIES = """
    SELECT instance, block_id, generation, tenant, pinned, holder FROM journal_slot_references
"""

WITH_ENTRIES = f"WITH live_entries AS ({_LIVE_ENTRIES}) "

JOURNALED_INSTANCES = text("SELECT count(*) FROM instance_owners")

# Each instance's counters (free, cached, in use, pinned only), then those states counted from
# its slots.
POOL_TALLIES = text("""
    SELECT i.instance, i.capacity_blocks,
           i.free_blocks, i.cached_blocks, i.blocks_in_use, i.pinned_blocks,
           c.free_blocks, c.cached_blocks, c.blocks_in_use, c.pinned_blocks
    FROM instance_pool_counters i JOIN journal_pool_counts c USING (instance)
    ORDER BY i.instance
""")

SLOTS_OUT_OF_RANGE = text(f"""
    {WITH_ENTRIES}
    SELECT * FROM (
        SELECT e.instance, e.block_id, e.holder AS named_by FROM live_entries e
        JOIN instances i USING (instance)
        WHERE e.block_id NOT BETWEEN 0 AND i.capacity_blocks - 1
        UNION ALL
        SELECT c.instance, c.block_id, 'contents recorded' FROM journal_slot_contents c
        JOIN instances i USING (instance)
        WHERE c.block_id NOT BETWEEN 0 AND i.capacity_blocks - 1
    ) outside
    ORDER BY instance, block_id LIMIT :limit
""")

# The rows that keep block arrays without being live (ending a reservation or a pin clears them).
ENTRIES_OF_ENDED_HOLDERS = text("""
    SELECT * FROM (
        SELECT 'tenants/' || tenant || '/reservations/' || request_id AS holder, instance, state,
               cardinality(block_ids) - coalesce(cardinality(released_positions), 0) AS entries
        FROM reservations
        WHERE block_ids IS NOT NULL AND state <> 'ADMITTED'
        UNION ALL
        SELECT owner || '/pins/' || pin_id, instance, state, cardinality(block_ids) FROM pins
        WHERE block_ids IS NOT NULL AND state <> 'ACTIVE'
    ) ended
    ORDER BY holder LIMIT :limit
""")

OFFLOADED_WITH_BLOCKS = text("""
    SELECT r.tenant, r.request_id, r.state FROM reservations r
    WHERE r.offloaded_bytes IS NOT NULL AND (
        (r.state = 'ADMITTED' AND r.suspended_at IS NULL)
        OR r.block_ids IS NOT NULL)
    ORDER BY r.tenant, r.request_id LIMIT :limit
""")

SLOTS_TWICE_IN_A_TABLE = text(f"""
    {WITH_ENTRIES}
    SELECT holder, instance, block_id, count(*) AS entries FROM live_entries
    GROUP BY holder, instance, block_id HAVING count(*) > 1
    ORDER BY holder, block_id LIMIT :limit
""")

# A journal row's arrays: a generation per slot, released positions inside the table, once.
MALFORMED_TABLES = text("""
    SELECT * FROM (
        SELECT 'tenants/' || tenant || '/reservations/' || request_id AS holder,
               cardinality(block_ids) AS slots, cardinality(block_generations) AS generations,
               released_positions::text AS released
        FROM reservations
        WHERE block_ids IS NOT NULL AND (
            cardinality(block_ids) IS DISTINCT FROM cardinality(block_generations)
            OR EXISTS (SELECT 1 FROM unnest(released_positions) AS x(p)
                       WHERE p NOT BETWEEN 0 AND cardinality(block_ids) - 1)
            OR coalesce(cardinality(released_positions), 0)
               <> (SELECT count(DISTINCT p) FROM unnest(released_positions) AS x(p)))
        UNION ALL
        SELECT owner || '/pins/' || pin_id, cardinality(block_ids), cardinality(block_generations),
               NULL
        FROM pins
        WHERE block_ids IS NOT NULL
          AND cardinality(block_ids) IS DISTINCT FROM cardinality(block_generations)
    ) malformed
    ORDER BY holder LIMIT :limit
""")

# Each tenant's fleet-wide counters (blocks, pinned blocks, tokens in flight, queued requests),
# then each counted from the record: blocks as distinct slots per instance, summed.
TENANT_TALLIES = text(f"""
    {WITH_ENTRIES}
    SELECT t.tenant, t.blocks_in_use, t.pinned_blocks, t.tokens_in_flight, t.queued_requests,
           coalesce(h.blocks, 0), coalesce(h.pinned, 0), coalesce(v.tokens, 0),
           coalesce(q.queued, 0)
    FROM tenants t
    LEFT JOIN (
        SELECT tenant, sum(blocks) AS blocks, sum(pinned) AS pinned FROM (
            SELECT tenant, instance, count(DISTINCT block_id) AS blocks,
                   count(DISTINCT block_id) FILTER (WHERE pinned) AS pinned
            FROM live_entries WHERE tenant IS NOT NULL GROUP BY tenant, instance
        ) per_instance GROUP BY tenant
    ) h USING (tenant)
    LEFT JOIN (SELECT tenant, sum(reserved_tokens) AS tokens FROM reservations
               WHERE state = 'ADMITTED' AND offloaded_bytes IS NULL
               GROUP BY tenant) v USING (tenant)
    LEFT JOIN (SELECT tenant, count(*) AS queued FROM reservations WHERE state = 'QUEUED'
               GROUP BY tenant) q USING (tenant)
    ORDER BY t.tenant
""")

# Each instance's queue counters (requests, prompt tokens), then those of its queued
# reservations.
QUEUE_TALLIES = text("""
    SELECT i.instance, i.queued_requests, i.queued_prompt_tokens,
           coalesce(q.n, 0), coalesce(q.tokens, 0)
    FROM instance_pool_counters i
    LEFT JOIN (SELECT instance, count(*) AS n, sum(prompt_tokens) AS tokens
               FROM reservations WHERE state = 'QUEUED' GROUP BY instance) q USING (instance)
    ORDER BY i.instance
""")

STALE_ENTRIES = text(f"""
    {WITH_ENTRIES}
    SELECT e.holder, e.instance, e.block_id, e.generation, g.generation AS current_generation
    FROM live_entries e
    JOIN journal_slot_contents g ON g.instance = e.instance AND g.block_id = e.block_id
    WHERE e.generation <> g.generation
    ORDER BY e.holder, e.block_id LIMIT :limit
""")

SLOTS_AT_TWO_GENERATIONS = text(f"""
    {WITH_ENTRIES}
    SELECT instance, block_id, array_agg(DISTINCT generation)::text AS generations
    FROM live_entries GROUP BY instance, block_id HAVING count(DISTINCT generation) > 1
    ORDER BY instance, block_id LIMIT :limit
""")

# The journal's contents: a whole digest, under a scope its checkpoint or delta names.
CONTENTS_WITHOUT_SCOPE = text("""
    SELECT instance, block_id, generation, octet_length(content_hash) AS hash_bytes, hash_scope
    FROM journal_slot_contents
    WHERE hash_scope IS NULL OR octet_length(content_hash) <> 32
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

PINS_MISSING_BLOCKS = text(f"""
    {WITH_ENTRIES}
    SELECT p.owner, p.pin_id, p.instance, p.pinned_blocks, count(e.block_id) AS entries
    FROM pins p
    LEFT JOIN live_entries e ON e.holder = p.owner || '/pins/' || p.pin_id
    WHERE p.state = 'ACTIVE'
    GROUP BY p.owner, p.pin_id, p.instance, p.pinned_blocks
    HAVING count(e.block_id) <> p.pinned_blocks
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

# Every journal write moves its owner's batch counter under the owner's epoch first, and
# records its deltas and checkpoints at that batch: a later one was written unfenced.
UNFENCED_BATCHES = text("""
    SELECT o.instance, o.epoch, o.batch AS owner_batch, w.written, w.batch FROM instance_owners o
    JOIN (SELECT instance, 'delta' AS written, batch FROM pool_deltas
          UNION ALL SELECT instance, 'checkpoint', batch FROM pool_checkpoints) w USING (instance)
    WHERE w.batch > o.batch OR o.epoch < 1
    ORDER BY o.instance, w.batch LIMIT :limit
""")


Judge = Callable[[Sequence[str], Sequence[tuple[Any, ...]], int], list[Offence]]


@dataclass(frozen=True)
class RecordQuery:
    """A query over the record, and how its rows are judged (the offences they show, the
    first `limit` of each check's)."""

    query: TextClause
    judge: Judge


def breaking(check: str, query: TextClause) -> RecordQuery:
    """A query that selects the rows breaking `check` (one more than shown, to say that there
    are more)."""
    return RecordQuery(query, partial(offence, check))


TallyOf = Callable[[Any, tuple[Any, ...], tuple[Any, ...]], Tally]


def counters(
    check: str,
    key: str,
    fields: Sequence[str],
    query: TextClause,
    tally: TallyOf = Tally,
    recorded: int | None = None,
) -> RecordQuery:
    """A query of a key, then the `recorded` counters (as many as `fields` unless said), then
    the same counted."""
    width = len(fields) if recorded is None else recorded
    return RecordQuery(query, partial(_counters, check, key, fields, tally, width))


def _counters(
    check: str,
    key: str,
    fields: Sequence[str],
    tally: TallyOf,
    width: int,
    columns: Sequence[str],
    rows: Sequence[tuple[Any, ...]],
    limit: int,
) -> list[Offence]:
    tallies = [tally(row[0], row[1 : 1 + width], row[1 + width :]) for row in rows]
    return tally_offences(check, key, fields, tallies, limit)


def _pool(instance: str, recorded: tuple[Any, ...], counted: tuple[Any, ...]) -> Tally:
    """POOL_TALLIES leads the recorded counters with the capacity."""
    capacity, *states = recorded
    return pool_tally(instance, capacity, states, counted)


# Each invariant the record shows: what of it the checks cover, and the checks.
CHECKED: dict[int, tuple[str, list[RecordQuery]]] = {
    1: (
        "each instance's counters against its slots (the journal's views)",
        [
            counters(
                "an instance's counters (recorded/counted) match its slots, and add up to its "
                "capacity",
                "instance",
                ("slots", "free", "cached", "in_use", "pinned"),
                POOL_TALLIES,
                _pool,
                recorded=5,
            ),
            breaking("every slot named or recorded is one of the instance's", SLOTS_OUT_OF_RANGE),
        ],
    ),
    2: (
        "entries of live holders only, each slot once per table, tables well formed (a slot's "
        "counts are derived from the entries naming it)",
        [
            breaking(
                "only admitted reservations and active pins hold entries", ENTRIES_OF_ENDED_HOLDERS
            ),
            breaking(
                "a session offloaded to the CPU tier is suspended and holds no entries",
                OFFLOADED_WITH_BLOCKS,
            ),
            breaking("no table or pin names a slot twice", SLOTS_TWICE_IN_A_TABLE),
            breaking(
                "a table's arrays: a generation per slot, released positions within it, once",
                MALFORMED_TABLES,
            ),
        ],
    ),
    3: (
        "each tenant's counters against its live entries, reservations and queue, summed over "
        "instances (within quota at admission: the admission tests)",
        [
            counters(
                "a tenant's counters (recorded/counted) match its live entries, reservations "
                "and queue",
                "tenant",
                ("blocks", "pinned", "tokens_in_flight", "queued"),
                TENANT_TALLIES,
            ),
            counters(
                "an instance's queue counters (recorded/counted) = its queued reservations",
                "instance",
                ("queued", "prompt_tokens"),
                QUEUE_TALLIES,
            ),
        ],
    ),
    4: (
        "live entries against current generations, recorded contents, salts (the hashes "
        "themselves: the hashing tests)",
        [
            breaking("no live entry names an outdated handle", STALE_ENTRIES),
            breaking("live entries name a slot at one generation", SLOTS_AT_TWO_GENERATIONS),
            breaking(
                "recorded contents are a whole hash under a known scope", CONTENTS_WITHOUT_SCOPE
            ),
            breaking("no two tenants or namespaces share a cache salt", SHARED_SALTS),
        ],
    ),
    6: (
        "each active pin holds its whole prefix (what a reclaim plan counts: the planner's tests)",
        [breaking("an active pin holds every block of its prefix", PINS_MISSING_BLOCKS)],
    ),
    7: (
        "the record's half; the crash half is `make stress`'s, which checks after every fault",
        [
            breaking(
                "a reservation is queued, admitted with a lease, or ended with a time and a reason",
                NEITHER_LIVE_NOR_ENDED,
            )
        ],
    ),
    8: (
        "the record's half: every journal batch fenced by its owner's epoch (each owner's "
        "memory: `kvquota check --server`)",
        [breaking("the journal holds no batch past its owner's counter", UNFENCED_BATCHES)],
    ),
}

NOT_CHECKED = {
    5: "a property of repeated calls, not of a record: the ledger's and the model's tests "
    "repeat them",
}
# Invariant 8 when no instance is served from memory.
NO_OWNERS = "no instance is served from memory: the record has no owner's epoch to check"

Rows = tuple[tuple[str, ...], list[tuple[Any, ...]]]


async def _read(engine: AsyncEngine, queries: Sequence[TextClause], limit: int) -> list[Rows]:
    """Each query's columns and rows, read in one round trip (the checks run after every step
    of the model tests) and one read-only, repeatable-read transaction. The queries go in the
    driver's pipeline as prepared statements, which the pooled connection keeps: a check run
    again plans nothing."""
    async with engine.connect() as conn:
        await conn.execution_options(isolation_level="AUTOCOMMIT")
        driver = (await conn.get_raw_connection()).driver_connection
        assert driver is not None
        params = {"limit": limit + 1}
        cursors = []
        try:
            async with driver.pipeline():
                await driver.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
                for query in queries:
                    cursor = driver.cursor()
                    sql = str(query.compile(dialect=conn.dialect))
                    await cursor.execute(sql, params, prepare=True)
                    cursors.append(cursor)
                await driver.execute("COMMIT")
            found: list[Rows] = []
            for cursor in cursors:
                columns = tuple(c.name for c in cursor.description)
                found.append((columns, await cursor.fetchall()))
                await cursor.close()
        except psycopg.Error as exc:
            # As every other read of the store fails: callers handle SQLAlchemy's errors.
            raise DBAPIError.instance(None, None, exc, psycopg.Error) from exc
        return found


async def check_record(engine: AsyncEngine, limit: int = DEFAULT_ROWS) -> list[InvariantReport]:
    """Every invariant in order: judged from the record, or not checked and why."""
    checks = [q for _, queries in CHECKED.values() for q in queries]
    (_, [(journaled,)]), *results = await _read(
        engine, [JOURNALED_INSTANCES, *(q.query for q in checks)], limit
    )
    offences: dict[int, list[Offence]] = {}
    for number, (_, queries) in CHECKED.items():
        offences[number] = [o for q in queries for o in q.judge(*results.pop(0), limit)]
    reports = []
    for number in INVARIANTS:
        if number in NOT_CHECKED:
            reports.append(not_checked(number, NOT_CHECKED[number]))
        elif number == 8 and not journaled:
            reports.append(not_checked(number, NO_OWNERS))
        else:
            reports.append(judged(number, CHECKED[number][0], offences[number]))
    return reports
