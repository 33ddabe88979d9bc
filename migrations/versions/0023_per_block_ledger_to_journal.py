"""The per-block ledger's live state carried into the instance journal

Until now the per-block ledger (`blocks`, `block_refs`, `tenant_blocks`) held what each instance
holds; from here an instance's owner rebuilds its machine from the journal (`Journal.load`). For
every instance the journal does not hold yet, this fills, from the per-block tables, in SQL set
operations (an instance of 1,000,000 slots takes seconds):

- each live reservation's row: an admitted one's block table in table order (`block_ids`,
  `block_generations`) with the entries given back early (`released_positions`, indexes into
  them); an offloaded one holds no table; a queued one its `queue_arrival`, numbered by when it
  joined the queue (ties of priority and fair-queueing start tag are dispatched in that order);
- each active pin's row: its block table;
- the instance's first `pool_checkpoints` row (batch 0): every slot holding a hash, with its
  generation, digest, scope, engine copies and place in the LRU order (the ledger's `lru_seq`,
  lowest evicted first; 0 for a referenced slot, which is in no LRU order);
- its `instance_owners` row, with no lease (the first replica to serve it claims it) and an
  epoch whose generation floor (`RecordedInstance.generation_floor` of the next claim) is above
  every generation the ledger handed out, so no handle from before is valid after; its clocks
  hold the fair-queueing virtual times (`fair_clocks`), each tenant's finish tags there
  (`fair_tags`), the instance's mean holding time and drift, and, for each tenant with fair tags,
  live reservations or pins there, the tenant's mean holding time (the ledger kept one per
  tenant across the fleet);
- its rows of `instance_tenant_totals` (what each tenant holds there, which owners of other
  instances read for its fleet-wide quota), which the per-block hot path did not keep up to
  date since migration 0022 filled them.

Reference counts, pool counters and tenants' holdings are derived from these as before, and the
per-block tables, usage history, tenants' fleet-wide totals and tombstones are left as they are.
An instance that already has an owner row is served from the journal already and is left alone.

Run it when the servers switch to the memory hot path (`KVQUOTA_HOT_PATH=memory`): a server left
on the per-block hot path after it changes the per-block tables only, and the journal falls
behind (downgrade and upgrade again to carry it over anew).

Downgrade clears what the upgrade wrote: the reservations' and pins' arrays and queue arrivals,
the checkpoints and the owner rows. It refuses, changing nothing, while any instance's journal
holds a batch an owner committed (since the upgrade, or before it on an instance served from
memory already): the per-block tables do not hold what that batch did, so going back would lose
it.

Revision ID: 0023
Revises: 0022
Create Date: 2026-12-02
"""

from __future__ import annotations

import logging

import sqlalchemy as sa
from alembic import op

from quota_service.core.hashing import DIGEST_BYTES
from quota_service.store.journal import GENERATIONS_PER_EPOCH

revision = "0023"
down_revision = "0022"
branch_labels = None
depends_on = None

log = logging.getLogger("alembic.runtime.migration")

# The owner row's name until a replica claims the instance.
OWNER = "migrations/0023"

_TO_CARRY = sa.text(
    "SELECT i.instance FROM instances i "
    "WHERE NOT EXISTS (SELECT 1 FROM instance_owners o WHERE o.instance = i.instance) "
    "ORDER BY i.instance"
)


def _tables(holders: str) -> str:
    """Each holder's block ids and generations in position order, and the indexes of its
    released entries (positions are 0, 1, ... already; an entry's rank does not depend on it)."""
    return f"""
    SELECT e.holder_id, array_agg(e.block_id ORDER BY e.position) AS block_ids,
           array_agg(e.generation ORDER BY e.position) AS generations,
           coalesce(array_agg(e.rank - 1 ORDER BY e.position) FILTER (WHERE e.released),
                    '{{}}') AS released
    FROM (SELECT b.*, row_number() OVER (PARTITION BY b.holder_id ORDER BY b.position) AS rank
          FROM ({holders}) AS h JOIN block_refs b ON b.holder_id = h.holder_id) AS e
    GROUP BY e.holder_id
    """


# An offloaded reservation has no references (its table left the GPU), so it gets no table.
_RESERVATION_TABLES = sa.text(
    "UPDATE reservations r SET block_ids = t.block_ids, block_generations = t.generations, "
    "released_positions = t.released FROM ("
    + _tables(
        "SELECT holder_id FROM reservations WHERE instance = :instance AND state = 'ADMITTED'"
    )
    + ") AS t WHERE r.holder_id = t.holder_id"
)

_QUEUE_ARRIVALS = sa.text(
    "UPDATE reservations r SET queue_arrival = q.arrival FROM ("
    "SELECT holder_id, row_number() OVER (ORDER BY queued_at, holder_id) AS arrival "
    "FROM reservations WHERE instance = :instance AND state = 'QUEUED') AS q "
    "WHERE r.holder_id = q.holder_id"
)

_PIN_TABLES = sa.text(
    "UPDATE pins p SET block_ids = t.block_ids, block_generations = t.generations FROM ("
    + _tables("SELECT holder_id FROM pins WHERE instance = :instance AND state = 'ACTIVE'")
    + ") AS t WHERE p.holder_id = t.holder_id"
)

# What each tenant holds on the instance as its fleet-wide totals count it (an offloaded
# reservation's tokens are not in flight).
_FORGET_TOTALS = sa.text("DELETE FROM instance_tenant_totals WHERE instance = :instance")
_TOTALS = sa.text(
    """
    INSERT INTO instance_tenant_totals
        (tenant, instance, blocks_in_use, tokens_in_flight, pinned_blocks, queued_requests)
    SELECT tenant, :instance, sum(blocks), sum(tokens), sum(pinned), sum(queued)
    FROM (
        SELECT tenant, count(*) AS blocks, 0 AS tokens,
               count(*) FILTER (WHERE pin_refs > 0) AS pinned, 0 AS queued
        FROM tenant_blocks WHERE instance = :instance GROUP BY tenant
        UNION ALL
        SELECT tenant, 0,
               coalesce(sum(reserved_tokens)
                        FILTER (WHERE state = 'ADMITTED' AND offloaded_bytes IS NULL), 0),
               0, count(*) FILTER (WHERE state = 'QUEUED')
        FROM reservations
        WHERE instance = :instance AND state IN ('ADMITTED', 'QUEUED') GROUP BY tenant
    ) AS held
    GROUP BY tenant
    """
)

_LIVE = sa.text(
    "SELECT count(*) FILTER (WHERE state = 'ADMITTED') AS admitted, "
    "count(*) FILTER (WHERE state = 'QUEUED') AS queued, "
    "(SELECT count(*) FROM pins WHERE instance = :instance AND state = 'ACTIVE') AS pins "
    "FROM reservations WHERE instance = :instance AND state IN ('ADMITTED', 'QUEUED')"
)

# One pass over the instance's slots: the highest generation the ledger handed out, and the
# scopes hashes were made under (a NULL among them is a hash without one).
_SURVEY = sa.text(
    """
    SELECT coalesce(max(generation), 0) AS generation,
           coalesce(array_agg(hash_scope ORDER BY hash_scope) FILTER (WHERE hashed), '{}')
               AS scopes
    FROM (SELECT hash_scope, content_hash IS NOT NULL AS hashed, max(generation) AS generation
          FROM blocks WHERE instance = :instance
          GROUP BY hash_scope, content_hash IS NOT NULL) AS s
    """
)

# The columns as store/journal.py writes a checkpoint (`_slot_arrays`): one entry per slot
# holding a hash, digests concatenated, scope ids indexing `scopes`. The aggregates take one
# stream of rows, so the arrays line up entry by entry (in no particular slot order: readers
# need none, and sorting a million slots would cost more than the rest).
_CHECKPOINT = sa.text(
    """
    INSERT INTO pool_checkpoints (
        instance, batch, scopes, slots, generations, digests, scope_ids, engine_copies, lru_seqs)
    SELECT CAST(:instance AS text), 0, CAST(:scopes AS text[]),
           coalesce(array_agg(block_id), '{}'), coalesce(array_agg(generation), '{}'),
           coalesce(string_agg(content_hash, ''::bytea), ''::bytea),
           coalesce(array_agg(array_position(CAST(:scopes AS text[]), hash_scope) - 1), '{}'),
           coalesce(array_agg(engine_copies), '{}'),
           coalesce(array_agg(CASE WHEN ref_count = 0 THEN lru_seq ELSE 0 END), '{}')
    FROM blocks WHERE instance = CAST(:instance AS text) AND content_hash IS NOT NULL
    RETURNING cardinality(slots) AS slots, octet_length(digests) AS digest_bytes,
              array_position(lru_seqs, NULL) IS NOT NULL AS unordered
    """
)

_OWNER = sa.text(
    """
    INSERT INTO instance_owners (instance, owner, address, epoch, batch, clocks)
    SELECT i.instance, :owner, '', :epoch, 0,
           jsonb_build_object(
               'virtual_time',
               coalesce((SELECT jsonb_object_agg(priority::text, virtual_time)
                         FROM fair_clocks WHERE instance = i.instance), '{}'),
               'mean_hold_seconds', i.mean_hold_seconds,
               'drift_blocks', i.drift_blocks)
           || coalesce((
               SELECT jsonb_object_agg(
                   'tenants/' || t.tenant,
                   jsonb_build_object('last_finish', coalesce(f.last_finish, '{}'),
                                      'mean_hold_seconds', t.mean_hold_seconds))
               FROM tenants t
               LEFT JOIN (SELECT tenant, jsonb_object_agg(priority::text, last_finish)
                              AS last_finish
                          FROM fair_tags WHERE instance = i.instance GROUP BY tenant) AS f
                 ON f.tenant = t.tenant
               WHERE f.tenant IS NOT NULL
                  OR t.tenant IN (SELECT tenant FROM reservations
                                  WHERE instance = i.instance AND state IN ('ADMITTED', 'QUEUED')
                                  UNION
                                  SELECT tenant FROM pins
                                  WHERE instance = i.instance AND state = 'ACTIVE')), '{}')
    FROM instances i WHERE i.instance = :instance
    """
)

# Batches are numbered from 1, so an instance at batch 0 has nothing journaled by an owner.
_MOVED_ON = sa.text("SELECT instance, batch FROM instance_owners WHERE batch > 0 ORDER BY instance")

_CLEAR = (
    "UPDATE reservations SET block_ids = NULL, block_generations = NULL, "
    "released_positions = NULL, queue_arrival = NULL "
    "WHERE block_ids IS NOT NULL OR released_positions IS NOT NULL OR queue_arrival IS NOT NULL",
    "UPDATE pins SET block_ids = NULL, block_generations = NULL WHERE block_ids IS NOT NULL",
    "DELETE FROM pool_checkpoints",
    "DELETE FROM instance_owners",
)


def upgrade() -> None:
    conn = op.get_bind()
    instances = conn.execute(_TO_CARRY).scalars().all()
    log.info("carrying %d instances from the per-block ledger to the journal", len(instances))
    for done, instance in enumerate(instances, 1):
        log.info(
            "instances/%s carried (%d of %d): %s",
            instance,
            done,
            len(instances),
            _carry(conn, instance),
        )


def _carry(conn: sa.Connection, instance: str) -> str:
    """Journal one instance; returns what it holds, for the log."""
    keys = {"instance": instance}
    conn.execute(_RESERVATION_TABLES, keys)
    conn.execute(_QUEUE_ARRIVALS, keys)
    conn.execute(_PIN_TABLES, keys)
    survey = conn.execute(_SURVEY, keys).mappings().one()
    if None in survey["scopes"]:
        raise _unfit(instance, "a block holds a hash with no scope")
    checkpoint = conn.execute(_CHECKPOINT, {**keys, "scopes": survey["scopes"]}).mappings().one()
    if checkpoint["digest_bytes"] != DIGEST_BYTES * checkpoint["slots"]:
        raise _unfit(instance, f"a block's content hash is not {DIGEST_BYTES} bytes long")
    if checkpoint["unordered"]:
        raise _unfit(instance, "a cached block has no place in the LRU order")
    conn.execute(_FORGET_TOTALS, keys)
    conn.execute(_TOTALS, keys)
    # The next owner claims epoch + 1, whose generations start at epoch x GENERATIONS_PER_EPOCH.
    epoch = survey["generation"] // GENERATIONS_PER_EPOCH + 1
    conn.execute(_OWNER, {**keys, "owner": OWNER, "epoch": epoch})
    live = conn.execute(_LIVE, keys).mappings().one()
    return (
        f"{live['admitted']} admitted and {live['queued']} queued reservations, "
        f"{live['pins']} pins, {checkpoint['slots']} slots holding a hash, epoch {epoch}"
    )


def _unfit(instance: str, why: str) -> RuntimeError:
    return RuntimeError(
        f"instances/{instance}: {why} (`kvquota check` tells more); nothing was migrated"
    )


def downgrade() -> None:
    conn = op.get_bind()
    moved_on = conn.execute(_MOVED_ON).all()
    if moved_on:
        served = ", ".join(f"instances/{name} at batch {batch}" for name, batch in moved_on)
        raise RuntimeError(
            "owners have journaled batches the per-block tables do not hold, and going back "
            f"would lose them: {served}; nothing was changed"
        )
    for statement in _CLEAR:
        op.execute(statement)
