"""The block pool in SQL: the pieces every operation on block tables is built from.

Each operation is one statement made of these CTE fragments, set-based over all of its blocks.
Callers hold the instance's row lock first, so block changes on one instance never interleave:
a prefix hit and the eviction of the same cached block cannot race.

- `ALLOCATE`: reference the cached prefix (`:hit_ids`), then take `:k` new blocks — never-hashed
  free slots first, then the least recently used cached ones, whose old handles are tombstoned —
  give them their contents (`:new_hashes`), and write the holder's entries and the tenant's refs.
- `drop(...)`: remove entries; a block whose last reference goes stays cached when it has a hash
  (evicted later, tail before head, as vLLM frees) or is freed and tombstoned.
- `POOL_COUNTS`: move the instance's per-state counters by the transitions the statement made.
"""

from __future__ import annotations

from sqlalchemy import RowMapping, text

from quota_service.core.block_table import BlockHandle

# Cached blocks are evicted in order of lru_seq: one sequence value per release, times this span,
# plus the entry's distance from the table's end, so a table's tail goes before its head.
LRU_SPAN = 1 << 20


def metering(shares: str, pins: str) -> str:
    """A CTE appending, per tenant, one usage event with the blocks it started or stopped
    holding by share (`shares`: tenant, k, delta) and its change of pinned blocks (`pins`:
    tenant, delta); see core/metering.py. Tenants with no change get no event."""
    return f"""metered_{shares} AS (
        INSERT INTO usage_events (tenant, instance, blocks, pinned)
        SELECT tenant, :instance,
               coalesce(jsonb_object_agg(k, delta) FILTER (WHERE k IS NOT NULL AND delta <> 0),
                        '{{}}'::jsonb),
               sum(pins)::int
        FROM (SELECT tenant, k::text AS k, delta, 0 AS pins FROM {shares}
              UNION ALL
              SELECT tenant, NULL, 0, delta FROM ({pins}) p(tenant, delta)) x
        GROUP BY tenant
        HAVING bool_or(delta <> 0) OR sum(pins) <> 0
        ORDER BY tenant
    )"""


_NEWLY_PINNED = "SELECT tenant, count(*) FROM tenant_refs WHERE pinned GROUP BY tenant"

ALLOCATE = f"""
    hit AS (
        -- Each hit with its state before: the update returns both, so no join of the two
        -- (the planner expects a handful of rows from a CTE, and would nest the loops).
        SELECT u.block_id, (u.ord - 1)::int AS position, b.state AS state_before
        FROM unnest(CAST(:hit_ids AS int[])) WITH ORDINALITY AS u(block_id, ord)
        JOIN blocks b ON b.instance = :instance AND b.block_id = u.block_id
    ), hit_after AS (
        UPDATE blocks b
        SET ref_count = b.ref_count + 1, pin_count = b.pin_count + :pin, lru_seq = NULL,
            last_used_at = now()
        FROM hit WHERE b.instance = :instance AND b.block_id = hit.block_id
        RETURNING b.block_id, b.generation, b.state, hit.position, hit.state_before
    ), candidate AS (
        SELECT block_id, generation, content_hash, state,
               row_number() OVER (ORDER BY reuse, ord) AS rank
        FROM (
            (SELECT block_id, generation, content_hash, state, 0 AS reuse, block_id::bigint AS ord
             FROM blocks WHERE instance = :instance AND state = 'FREE'
             ORDER BY block_id LIMIT :k)
            UNION ALL
            (SELECT block_id, generation, content_hash, state, 1, lru_seq
             FROM blocks WHERE instance = :instance AND state = 'CACHED'
               AND block_id <> ALL (CAST(:hit_ids AS int[]))
             ORDER BY lru_seq LIMIT :k)
        ) c
        ORDER BY reuse, ord LIMIT :k
    ), evicted AS (
        INSERT INTO tombstones (
            instance, block_id, generation, content_hash, reason, tenant, freed_at)
        SELECT :instance, block_id, generation, content_hash, 'EVICTED', :tenant, now()
        FROM candidate WHERE state = 'CACHED'
    ), allocated AS (
        UPDATE blocks b
        SET generation = b.generation + CASE WHEN c.state = 'CACHED' THEN 1 ELSE 0 END,
            content_hash = n.content_hash,
            hash_scope = CASE WHEN n.content_hash IS NULL THEN NULL ELSE :hash_scope END,
            ref_count = 1, pin_count = :pin, lru_seq = NULL, last_used_at = now(),
            engine_confirmed_at = NULL, engine_copies = 0
        FROM candidate c
        JOIN unnest(CAST(:new_hashes AS bytea[])) WITH ORDINALITY AS n(content_hash, rank)
          USING (rank)
        WHERE b.instance = :instance AND b.block_id = c.block_id
        RETURNING b.block_id, b.generation, c.rank, c.state AS state_before, b.state
    ), entries AS (
        SELECT position, block_id, generation FROM hit_after
        UNION ALL
        SELECT (:hit_count + rank - 1)::int, block_id, generation FROM allocated
    ), refs AS (
        INSERT INTO block_refs (holder_id, position, instance, block_id, generation, tenant, pinned)
        SELECT :holder, position, :instance, block_id, generation, :tenant, :pin = 1 FROM entries
        RETURNING position
    ), tenant_refs AS (
        INSERT INTO tenant_blocks AS t (tenant, instance, block_id, generation, refs, pin_refs)
        SELECT :tenant, :instance, block_id, generation, 1, :pin FROM entries
        WHERE :tenant IS NOT NULL
        ON CONFLICT (tenant, instance, block_id) DO UPDATE
        SET refs = t.refs + 1, pin_refs = t.pin_refs + :pin
        RETURNING t.tenant, t.block_id, (t.refs = 1) AS added,
                  (:pin = 1 AND t.pin_refs = 1) AS pinned
    ), transitions AS (
        SELECT state_before, state FROM hit_after
        UNION ALL
        SELECT state_before, state FROM allocated
    ), joined AS (
        -- Blocks the tenant starts holding, and how many other tenants held each (the
        -- statement's own insert is not seen here).
        SELECT r.tenant, r.block_id,
               (SELECT count(*) FROM tenant_blocks o
                WHERE o.instance = :instance AND o.block_id = r.block_id) AS others
        FROM tenant_refs r WHERE r.added
    ), joined_shares AS (
        SELECT tenant, others + 1 AS k, count(*) AS delta FROM joined GROUP BY tenant, others
        UNION ALL
        -- Each other holder now shares the block one way more.
        SELECT o.tenant, m.k, sum(m.delta) FROM joined j
        JOIN tenant_blocks o ON o.instance = :instance AND o.block_id = j.block_id
        CROSS JOIN LATERAL (VALUES (j.others, -1), (j.others + 1, 1)) AS m(k, delta)
        WHERE j.others > 0
        GROUP BY o.tenant, m.k
    ), {metering("joined_shares", _NEWLY_PINNED)}"""


def drop(dropped: str) -> str:
    """CTEs that remove the entries `dropped` deletes or marks released; it must return
    block_id, position, pinned and tenant of each, all on :instance."""
    return f"""
    dropped AS ({dropped}),
    per_block AS (
        -- With each block's state before, returned by the update (see ALLOCATE's hit).
        SELECT p.*, b.state AS state_before
        FROM (SELECT block_id, count(*) AS refs, count(*) FILTER (WHERE pinned) AS pins,
                     max(position) AS position
              FROM dropped GROUP BY block_id) p
        JOIN blocks b ON b.instance = :instance AND b.block_id = p.block_id
    ), lru AS (
        SELECT nextval('block_lru') AS base
    ), block_after AS (
        UPDATE blocks b
        SET ref_count = b.ref_count - p.refs,
            pin_count = b.pin_count - p.pins,
            lru_seq = CASE WHEN b.ref_count = p.refs
                THEN lru.base * {LRU_SPAN} + ({LRU_SPAN} - 1 - p.position) ELSE b.lru_seq END,
            generation = CASE WHEN b.ref_count = p.refs AND b.content_hash IS NULL
                THEN b.generation + 1 ELSE b.generation END,
            last_used_at = now()
        FROM per_block p, lru
        WHERE b.instance = :instance AND b.block_id = p.block_id
        RETURNING b.block_id, b.generation, b.state, p.state_before
    ), freed AS (
        INSERT INTO tombstones (
            instance, block_id, generation, content_hash, reason, tenant, freed_at)
        SELECT :instance, block_id, generation - 1, NULL, 'FREED', :tenant, now()
        FROM block_after WHERE state = 'FREE'
    ), transitions AS (
        SELECT state_before, state FROM block_after
    ), per_tenant AS (
        -- Each tenant's row of each block, found by a key lookup per block (LIMIT keeps the
        -- subquery a parameterised probe) and then changed by its row id: a plan that does not
        -- depend on how many rows the planner expects, or the instance holds.
        SELECT p.*, h.row_id, h.held
        FROM (SELECT tenant, block_id, count(*) AS refs, count(*) FILTER (WHERE pinned) AS pins
              FROM dropped WHERE tenant IS NOT NULL GROUP BY tenant, block_id) p
        CROSS JOIN LATERAL (
            SELECT t.ctid AS row_id, t.refs AS held FROM tenant_blocks t
            WHERE t.tenant = p.tenant AND t.instance = :instance AND t.block_id = p.block_id
            LIMIT 1) h
    ), tenant_kept AS (
        UPDATE tenant_blocks t SET refs = t.refs - p.refs, pin_refs = t.pin_refs - p.pins
        FROM per_tenant p
        WHERE t.ctid = p.row_id AND p.held > p.refs
        RETURNING t.tenant, false AS removed, (t.pin_refs = 0 AND p.pins > 0) AS unpinned
    ), tenant_gone AS (
        DELETE FROM tenant_blocks t USING per_tenant p
        WHERE t.ctid = p.row_id AND p.held <= p.refs
        RETURNING t.tenant, true AS removed, t.pin_refs > 0 AS unpinned, t.block_id
    ), tenant_changes AS (
        SELECT tenant, count(*) FILTER (WHERE removed) AS removed,
               count(*) FILTER (WHERE unpinned) AS unpinned
        FROM (SELECT tenant, removed, unpinned FROM tenant_kept
              UNION ALL SELECT tenant, removed, unpinned FROM tenant_gone) c
        GROUP BY tenant
    ), left_blocks AS (
        -- Blocks a tenant stops holding, and how many tenants held each, it included.
        SELECT g.tenant, g.block_id,
               (SELECT count(*) FROM tenant_blocks o
                WHERE o.instance = :instance AND o.block_id = g.block_id) AS holders
        FROM tenant_gone g
    ), left_shares AS (
        SELECT tenant, holders AS k, -count(*) AS delta FROM left_blocks GROUP BY tenant, holders
        UNION ALL
        -- Each remaining holder now shares the block one way less.
        SELECT o.tenant, m.k, sum(m.delta) FROM left_blocks l
        JOIN tenant_blocks o
          ON o.instance = :instance AND o.block_id = l.block_id AND o.tenant <> l.tenant
        CROSS JOIN LATERAL (VALUES (l.holders, -1), (l.holders - 1, 1)) AS m(k, delta)
        -- An unshared block has no other holder: not probing for one keeps a release's cost
        -- independent of how many blocks the instance's tenants hold.
        WHERE l.holders > 1
        GROUP BY o.tenant, m.k
    ), {metering("left_shares", "SELECT tenant, -unpinned FROM tenant_changes")}"""


def pool_counts(extra_set: str = "", extra_from: str = "") -> str:
    """The instance update for a statement's `transitions`, plus any other column the statement
    sets on the instance (a statement may update a row only once)."""
    deltas = ",\n".join(
        f"count(*) FILTER (WHERE state = '{state}') "
        f"- count(*) FILTER (WHERE state_before = '{state}') AS {column}"
        for state, column in _STATE_COLUMNS
    )
    sets = ", ".join(f"{column} = i.{column} + d.{column}" for _, column in _STATE_COLUMNS)
    return f"""
    pool AS (
        UPDATE instances i SET {sets}{", " + extra_set if extra_set else ""}
        FROM (SELECT {deltas} FROM transitions) d{", " + extra_from if extra_from else ""}
        WHERE i.instance = :instance
        RETURNING i.instance, i.queued_requests
    )"""


# Select-list item: wakes every replica's dispatcher when blocks came back on an instance that
# has requests waiting (nothing is sent otherwise).
NOTIFY_RELEASED = """
    (SELECT count(*) FROM (
        SELECT pg_notify('kvquota_events', 'released:' || instance) FROM pool
        WHERE queued_requests > 0) n) AS dispatch_notified"""


def tenant_additions(extra_set: str = "") -> str:
    """The tenant update after ALLOCATE: blocks it newly references and newly pins."""
    return f"""
    account AS (
        UPDATE tenants
        SET blocks_in_use = blocks_in_use
                + (SELECT count(*) FILTER (WHERE added) FROM tenant_refs),
            pinned_blocks = pinned_blocks
                + (SELECT count(*) FILTER (WHERE pinned) FROM tenant_refs){extra_set}
        WHERE tenant = :tenant
    )"""


# The tenant update after drop(...) when nothing else of the tenant changes.
TENANT_REMOVALS = """
    account AS (
        UPDATE tenants t
        SET blocks_in_use = t.blocks_in_use - c.removed,
            pinned_blocks = t.pinned_blocks - c.unpinned
        FROM tenant_changes c WHERE t.tenant = c.tenant
    )"""

_STATE_COLUMNS = (
    ("FREE", "free_blocks"),
    ("CACHED", "cached_blocks"),
    ("IN_USE", "blocks_in_use"),
    ("PINNED", "pinned_blocks"),
)

# The cached blocks a prefix could reuse, with what the requesting tenant already holds of them.
# Driven by the hashes, each looked up by key (OFFSET 0 and LIMIT keep the subqueries
# parameterised probes): left to itself, the planner trusted statistics that said an instance
# held few hashed blocks or a tenant few blocks, and scanned all of them instead, so an Admit
# grew slower with the pool's history.
PREFIX_LOOKUP = """
    SELECT DISTINCT ON (h.content_hash)
           h.content_hash, b.block_id, b.generation, b.state = 'CACHED' AS evictable,
           tb.pin_refs IS NOT NULL AS held_by_tenant,
           coalesce(tb.pin_refs, 0) > 0 AS pinned_by_tenant
    FROM unnest(CAST(:hashes AS bytea[])) AS h(content_hash)
    CROSS JOIN LATERAL (
        SELECT s.block_id, s.generation, s.state FROM blocks s
        WHERE s.instance = :instance AND s.content_hash = h.content_hash OFFSET 0) b
    LEFT JOIN LATERAL (
        SELECT t.pin_refs FROM tenant_blocks t
        WHERE t.tenant = :tenant AND t.instance = :instance AND t.block_id = b.block_id
        LIMIT 1) tb ON true
    -- Where a hash is on several slots: the tenant's own copy (free to share), then one in use
    -- (reusing it costs no evictable slot), then the lowest id.
    ORDER BY h.content_hash, tb.pin_refs IS NULL, b.state = 'CACHED', b.block_id
"""


def live_table(holder_id: str) -> str:
    """Select-list items for a holder's live block table, in position order; read them back
    with `table_from_row`."""
    return f"""
           (SELECT array_agg(t.block_id ORDER BY t.position) FROM block_refs t
            WHERE t.holder_id = {holder_id} AND NOT t.released) AS table_block_ids,
           (SELECT array_agg(t.generation ORDER BY t.position) FROM block_refs t
            WHERE t.holder_id = {holder_id} AND NOT t.released) AS table_generations"""


def table_from_row(row: RowMapping) -> tuple[BlockHandle, ...]:
    """The table `live_table` selected (none when the row was read without it)."""
    block_ids = row.get("table_block_ids") or []
    generations = row.get("table_generations") or []
    return tuple(BlockHandle(b, g) for b, g in zip(block_ids, generations, strict=True))


# A tenant as an admission or a pin sees it, under its row lock (the instance is locked first).
# A locking statement selects only the rows it locks: rows it merely joins would be read from the
# snapshot taken before it waited for the lock, so the salt is read by the next statement.
TENANT_ACCOUNT_COLUMNS = """
           t.state AS account_state, t.max_blocks, t.max_tokens_in_flight,
           t.max_queued_requests, t.max_pinned_blocks, t.max_cpu_tier_bytes,
           t.blocks_in_use AS account_blocks, t.tokens_in_flight,
           t.mean_hold_seconds AS account_hold, t.pinned_blocks AS account_pinned,
           t.shadow_mode AS account_shadow_mode"""

# Select-list items of tenant `t`: the salt its prefixes are hashed under, and whose it is (its
# own, or its namespace's). Subqueries, not a join, so that in a statement locking `t` they are
# evaluated for the tenant row as it is once locked.
SALT_COLUMNS = """
           coalesce((SELECT ns.cache_salt FROM namespaces ns WHERE ns.namespace = t.namespace),
                    t.cache_salt) AS cache_salt,
           CASE WHEN t.namespace IS NULL THEN 'tenants/' || t.tenant
                ELSE 'namespaces/' || t.namespace END AS hash_scope"""

TENANT_SALT = f"SELECT {SALT_COLUMNS} FROM tenants t WHERE t.tenant = :tenant"


LOCK_INSTANCE = text("SELECT 1 FROM instances WHERE instance = :instance FOR UPDATE")
# Always after the instance's row (the ledger's lock order).
LOCK_TENANT = text("SELECT 1 FROM tenants WHERE tenant = :tenant FOR UPDATE")


def drop_contents(victims: str, reason: str, tenant: str = "NULL") -> str:
    """Free the unreferenced cached blocks `victims` selects (block_id, state, content_hash),
    tombstone their handles (for `tenant`, an SQL expression, when one tenant's action freed
    them), count referenced ones as drift, and move the pool's counters."""
    return f"""
    WITH victim AS ({victims}), block_after AS (
        UPDATE blocks b
        SET generation = b.generation + 1, content_hash = NULL, hash_scope = NULL,
            lru_seq = NULL, engine_confirmed_at = NULL, engine_copies = 0
        FROM victim v
        WHERE b.instance = :instance AND b.block_id = v.block_id AND v.state = 'CACHED'
        RETURNING b.block_id, b.generation, b.state
    ), tombstoned AS (
        INSERT INTO tombstones (
            instance, block_id, generation, content_hash, reason, tenant, freed_at)
        SELECT :instance, a.block_id, a.generation - 1, v.content_hash, '{reason}', {tenant},
               now()
        FROM block_after a JOIN victim v USING (block_id)
    ), transitions AS (
        SELECT v.state AS state_before, a.state
        FROM block_after a JOIN victim v USING (block_id)
    ), {
        pool_counts(
            "drift_blocks = i.drift_blocks + "
            "(SELECT count(*) FROM victim WHERE state IN ('IN_USE', 'PINNED'))"
        )
    }
    SELECT (SELECT count(*) FROM block_after) AS freed,
           (SELECT count(*) FROM victim WHERE state IN ('IN_USE', 'PINNED')) AS drift,
           {NOTIFY_RELEASED}
    """
