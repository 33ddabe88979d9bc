"""The instance journal: instances served from memory by an owner, recorded in O(1) rows per
operation

An instance's owner keeps its pool in memory (core/instance_machine.py) and journals each batch
of operations in one transaction: reservation and pin rows carry their block tables as arrays,
each batch appends one row of changed slot contents (pool_deltas) after a checkpoint
(pool_checkpoints), and instance_owners fences every batch by the owner's epoch. The views derive
what the per-block tables stored: each slot's contents, references and state, each pool's
counters, and each tenant's holdings per instance, for operators and the invariant checks.

Revision ID: 0021
Revises: 0020
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import ARRAY, JSONB

revision = "0021"
down_revision = "0020"
branch_labels = None
depends_on = None

# The latest recorded state of every slot that ever held a hash: a checkpoint's entries, then
# each later delta's, the newest winning; dropped slots hold nothing.
SLOT_CONTENTS = """
CREATE VIEW journal_slot_contents AS
SELECT instance, block_id, generation, content_hash, hash_scope, engine_copies, lru_seq
FROM (
    SELECT DISTINCT ON (instance, block_id) *
    FROM (
        SELECT c.instance, c.batch, s.block_id, s.generation,
               substring(c.digests FROM (s.n::int - 1) * 32 + 1 FOR 32) AS content_hash,
               c.scopes[s.scope_id + 1] AS hash_scope, s.engine_copies, s.lru_seq
        FROM pool_checkpoints c,
             unnest(c.slots, c.generations, c.scope_ids, c.engine_copies, c.lru_seqs)
                 WITH ORDINALITY AS s(block_id, generation, scope_id, engine_copies, lru_seq, n)
        UNION ALL
        SELECT d.instance, d.batch, s.block_id, s.generation,
               substring(d.digests FROM (s.n::int - 1) * 32 + 1 FOR 32),
               d.scopes[s.scope_id + 1], s.engine_copies, s.lru_seq
        FROM pool_deltas d,
             unnest(d.slots, d.generations, d.scope_ids, d.engine_copies, d.lru_seqs)
                 WITH ORDINALITY AS s(block_id, generation, scope_id, engine_copies, lru_seq, n)
        UNION ALL
        SELECT d.instance, d.batch, x.block_id, NULL, NULL, NULL, NULL, NULL
        FROM pool_deltas d, unnest(d.dropped) AS x(block_id)
    ) AS recorded
    ORDER BY instance, block_id, batch DESC
) AS latest
WHERE content_hash IS NOT NULL
"""

# Every live block-table entry and pin entry, one row each.
SLOT_REFERENCES = """
CREATE VIEW journal_slot_references AS
SELECT r.instance, e.block_id, e.generation, r.tenant, false AS pinned,
       'tenants/' || r.tenant || '/reservations/' || r.request_id AS holder
FROM reservations r,
     unnest(r.block_ids, r.block_generations) WITH ORDINALITY AS e(block_id, generation, position)
WHERE r.state = 'ADMITTED' AND r.block_ids IS NOT NULL
  AND (e.position - 1) <> ALL (coalesce(r.released_positions, '{}'))
UNION ALL
SELECT p.instance, e.block_id, e.generation, p.tenant, true, p.owner || '/pins/' || p.pin_id
FROM pins p, unnest(p.block_ids, p.block_generations) AS e(block_id, generation)
WHERE p.state = 'ACTIVE' AND p.block_ids IS NOT NULL
"""

# Each slot that holds anything, with its counts and state (as BlockRow.state says them).
SLOTS = """
CREATE VIEW journal_slots AS
SELECT coalesce(c.instance, r.instance) AS instance, coalesce(c.block_id, r.block_id) AS block_id,
       coalesce(c.generation, r.generation) AS generation, c.content_hash, c.hash_scope,
       coalesce(r.ref_count, 0) AS ref_count, coalesce(r.pin_count, 0) AS pin_count,
       coalesce(c.engine_copies, 0) AS engine_copies, c.lru_seq,
       CASE WHEN coalesce(r.ref_count, 0) = 0 THEN 'CACHED'
            WHEN r.ref_count = r.pin_count THEN 'PINNED' ELSE 'IN_USE' END AS state
FROM journal_slot_contents c
FULL JOIN (
    SELECT instance, block_id, min(generation) AS generation, count(*) AS ref_count,
           count(*) FILTER (WHERE pinned) AS pin_count
    FROM journal_slot_references GROUP BY instance, block_id
) AS r ON r.instance = c.instance AND r.block_id = c.block_id
"""

POOL_COUNTS = """
CREATE VIEW journal_pool_counts AS
SELECT i.instance, i.capacity_blocks,
       i.capacity_blocks - count(s.block_id) AS free_blocks,
       count(s.block_id) FILTER (WHERE s.state = 'CACHED') AS cached_blocks,
       count(s.block_id) FILTER (WHERE s.state = 'IN_USE') AS blocks_in_use,
       count(s.block_id) FILTER (WHERE s.state = 'PINNED') AS pinned_blocks
FROM instances i LEFT JOIN journal_slots s ON s.instance = i.instance
GROUP BY i.instance, i.capacity_blocks
"""

# A tenant's holdings on an instance: the distinct slots its live tables and pins name.
TENANT_HOLDINGS = """
CREATE VIEW journal_tenant_holdings AS
SELECT h.tenant, h.instance, h.blocks_in_use, h.pinned_blocks,
       coalesce(t.tokens_in_flight, 0) AS tokens_in_flight
FROM (
    SELECT tenant, instance, count(DISTINCT block_id) AS blocks_in_use,
           count(DISTINCT block_id) FILTER (WHERE pinned) AS pinned_blocks
    FROM journal_slot_references WHERE tenant IS NOT NULL GROUP BY tenant, instance
) AS h
LEFT JOIN (
    SELECT tenant, instance, sum(reserved_tokens) AS tokens_in_flight
    FROM reservations WHERE state = 'ADMITTED' AND block_ids IS NOT NULL
    GROUP BY tenant, instance
) AS t ON t.tenant = h.tenant AND t.instance = h.instance
"""

# Every batch of an owner starts here: it moves the batch on only under the owner's epoch and
# otherwise fails the transaction (SQLSTATE KQ001), so that a whole batch can be sent in one
# round trip and a deposed owner's batch still commits nothing.
NEXT_BATCH = """
CREATE FUNCTION journal_next_batch(p_instance text, p_epoch bigint, p_clocks jsonb)
RETURNS bigint LANGUAGE plpgsql AS $$
DECLARE
    moved bigint;
BEGIN
    UPDATE instance_owners SET batch = batch + 1, clocks = clocks || p_clocks
    WHERE instance = p_instance AND epoch = p_epoch RETURNING batch INTO moved;
    IF moved IS NULL THEN
        RAISE EXCEPTION 'instance % has an owner newer than epoch %', p_instance, p_epoch
            USING ERRCODE = 'KQ001';
    END IF;
    RETURN moved;
END
$$
"""

# A batch's new reservations must not replace old ones of the same request ids (ended long ago,
# forgotten by the owner's memory): the statement that inserts them fails the batch with those
# ids (SQLSTATE KQ002), and the owner answers them from the record instead.
FRESH = """
CREATE FUNCTION journal_fresh(p_reused text[])
RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    IF cardinality(p_reused) > 0 THEN
        RAISE EXCEPTION '%', array_to_string(p_reused, ' ') USING ERRCODE = 'KQ002';
    END IF;
END
$$
"""

VIEWS = (
    ("journal_slot_contents", SLOT_CONTENTS),
    ("journal_slot_references", SLOT_REFERENCES),
    ("journal_slots", SLOTS),
    ("journal_pool_counts", POOL_COUNTS),
    ("journal_tenant_holdings", TENANT_HOLDINGS),
)


def _slot_arrays() -> list[sa.Column[object]]:
    return [
        sa.Column("scopes", ARRAY(sa.Text()), nullable=False),
        sa.Column("slots", ARRAY(sa.Integer()), nullable=False),
        sa.Column("generations", ARRAY(sa.BigInteger()), nullable=False),
        sa.Column("digests", sa.LargeBinary(), nullable=False),
        sa.Column("scope_ids", ARRAY(sa.Integer()), nullable=False),
        sa.Column("engine_copies", ARRAY(sa.Integer()), nullable=False),
        sa.Column("lru_seqs", ARRAY(sa.BigInteger()), nullable=False),
    ]


def upgrade() -> None:
    for table in ("reservations", "pins"):
        op.add_column(table, sa.Column("block_ids", ARRAY(sa.Integer()), nullable=True))
        op.add_column(table, sa.Column("block_generations", ARRAY(sa.BigInteger()), nullable=True))
    op.add_column("reservations", sa.Column("released_positions", ARRAY(sa.Integer())))
    op.add_column("reservations", sa.Column("queue_arrival", sa.BigInteger()))
    op.create_table(
        "instance_owners",
        sa.Column("instance", sa.String(63), nullable=False),
        sa.Column("owner", sa.String(200), nullable=False),
        sa.Column("address", sa.String(200), server_default="", nullable=False),
        sa.Column("epoch", sa.BigInteger(), nullable=False),
        sa.Column("lease_expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("batch", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("clocks", JSONB(), server_default=sa.text("'{}'::jsonb"), nullable=False),
        sa.ForeignKeyConstraint(
            ["instance"], ["instances.instance"], name="fk_instance_owners_instance_instances"
        ),
        sa.PrimaryKeyConstraint("instance", name="pk_instance_owners"),
    )
    op.create_table(
        "pool_checkpoints",
        sa.Column("instance", sa.String(63), nullable=False),
        sa.Column("batch", sa.BigInteger(), nullable=False),
        *_slot_arrays(),
        sa.Column(
            "written_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
        sa.ForeignKeyConstraint(
            ["instance"], ["instances.instance"], name="fk_pool_checkpoints_instance_instances"
        ),
        sa.PrimaryKeyConstraint("instance", name="pk_pool_checkpoints"),
    )
    op.create_table(
        "pool_deltas",
        sa.Column("instance", sa.String(63), nullable=False),
        sa.Column("batch", sa.BigInteger(), nullable=False),
        *_slot_arrays(),
        sa.Column("dropped", ARRAY(sa.Integer()), nullable=False),
        sa.ForeignKeyConstraint(
            ["instance"], ["instances.instance"], name="fk_pool_deltas_instance_instances"
        ),
        sa.PrimaryKeyConstraint("instance", "batch", name="pk_pool_deltas"),
    )
    for _, statement in VIEWS:
        op.execute(statement)
    op.execute(NEXT_BATCH)
    op.execute(FRESH)


def downgrade() -> None:
    op.execute("DROP FUNCTION journal_fresh(text[])")
    op.execute("DROP FUNCTION journal_next_batch(text, bigint, jsonb)")
    for name, _ in reversed(VIEWS):
        op.execute(f"DROP VIEW {name}")
    op.drop_table("pool_deltas")
    op.drop_table("pool_checkpoints")
    op.drop_table("instance_owners")
    op.drop_column("reservations", "queue_arrival")
    op.drop_column("reservations", "released_positions")
    for table in ("pins", "reservations"):
        op.drop_column(table, "block_generations")
        op.drop_column(table, "block_ids")
