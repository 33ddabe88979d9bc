"""The per-block ledger's tables go

Every instance is served from its owner's memory and recorded by the journal (0021 to 0025); the
per-block ledger's tables (`blocks`, `block_refs`, `tenant_blocks`, `tombstones`), its fair-queueing
tables (`fair_clocks`, `fair_tags`, carried into the owners' clocks by 0023) and its LRU sequence
are read and written by nothing any more.

The upgrade refuses, changing nothing, while an instance that has no owner row (so 0023 did not
carry it into the journal: it was registered afterwards on a server still on the per-block hot
path) holds references or cached blocks in those tables: downgrade to 0022 and upgrade again to
carry it over first.

The downgrade makes the tables again, empty but for one free row per slot of every instance (what
registering an instance made), and refuses, changing nothing, while the journal holds any live
reservation's or pin's block table or any cached slot: those the tables would not hold.

Revision ID: 0026
Revises: 0025
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0026"
down_revision = "0025"
branch_labels = None
depends_on = None

TABLES = ("tenant_blocks", "block_refs", "tombstones", "fair_tags", "fair_clocks", "blocks")

UNCARRIED = """
SELECT i.instance FROM instances i
WHERE NOT EXISTS (SELECT 1 FROM instance_owners o WHERE o.instance = i.instance)
  AND (EXISTS (SELECT 1 FROM block_refs r WHERE r.instance = i.instance)
       OR EXISTS (SELECT 1 FROM blocks b
                  WHERE b.instance = i.instance AND b.content_hash IS NOT NULL))
ORDER BY i.instance
"""

# The tables as 0025 left them (their indexes and constraints included).
PER_BLOCK_TABLES = """
CREATE SEQUENCE block_lru;
CREATE TABLE blocks (
    instance varchar(63) NOT NULL REFERENCES instances (instance),
    block_id integer NOT NULL,
    generation bigint DEFAULT 0 NOT NULL,
    ref_count integer DEFAULT 0 NOT NULL,
    pin_count integer DEFAULT 0 NOT NULL,
    content_hash bytea,
    hash_scope varchar(80),
    tier varchar(16) DEFAULT 'GPU' NOT NULL,
    lru_seq bigint,
    last_used_at timestamptz,
    state varchar(8) GENERATED ALWAYS AS (
        CASE
            WHEN ref_count = 0 AND content_hash IS NULL THEN 'FREE'
            WHEN ref_count = 0 THEN 'CACHED'
            WHEN ref_count = pin_count THEN 'PINNED'
            ELSE 'IN_USE'
        END) STORED NOT NULL,
    event_hash bigint GENERATED ALWAYS AS (
        CASE
            WHEN content_hash IS NULL THEN NULL
            ELSE ('x' || encode(substring(content_hash FROM 25 FOR 8), 'hex'))::bit(64)::bigint
        END) STORED,
    engine_confirmed_at timestamptz,
    engine_copies integer DEFAULT 0 NOT NULL,
    CONSTRAINT pk_blocks PRIMARY KEY (instance, block_id),
    CONSTRAINT ck_blocks_refs CHECK (pin_count >= 0 AND ref_count >= pin_count),
    CONSTRAINT ck_blocks_tier CHECK (tier IN ('GPU', 'CPU', 'COMPRESSED'))
) WITH (autovacuum_vacuum_scale_factor = 0.02, autovacuum_analyze_scale_factor = 0.02);
CREATE INDEX ix_blocks_cached_lru ON blocks (instance, lru_seq) WHERE state = 'CACHED';
CREATE INDEX ix_blocks_event_hash ON blocks (instance, event_hash) WHERE event_hash IS NOT NULL;
CREATE INDEX ix_blocks_free ON blocks (instance, block_id) WHERE state = 'FREE';
CREATE INDEX ix_blocks_hash ON blocks (instance, content_hash) WHERE content_hash IS NOT NULL;
CREATE TABLE block_refs (
    holder_id bigint NOT NULL,
    position integer NOT NULL,
    instance varchar(63) NOT NULL,
    block_id integer NOT NULL,
    generation bigint NOT NULL,
    tenant varchar(63),
    pinned boolean NOT NULL,
    released boolean DEFAULT false NOT NULL,
    CONSTRAINT pk_block_refs PRIMARY KEY (holder_id, position)
) WITH (autovacuum_vacuum_scale_factor = 0.02, autovacuum_analyze_scale_factor = 0.02);
CREATE INDEX ix_block_refs_block ON block_refs (instance, block_id) WHERE NOT released;
CREATE TABLE tenant_blocks (
    tenant varchar(63) NOT NULL,
    instance varchar(63) NOT NULL,
    block_id integer NOT NULL,
    generation bigint NOT NULL,
    refs integer NOT NULL,
    pin_refs integer NOT NULL,
    CONSTRAINT pk_tenant_blocks PRIMARY KEY (tenant, instance, block_id),
    CONSTRAINT ck_tenant_blocks_refs CHECK (refs > 0 AND pin_refs >= 0 AND pin_refs <= refs)
) WITH (autovacuum_vacuum_scale_factor = 0.02, autovacuum_analyze_scale_factor = 0.02);
CREATE INDEX ix_tenant_blocks_instance_block_id ON tenant_blocks (instance, block_id);
CREATE TABLE tombstones (
    instance varchar(63) NOT NULL,
    block_id integer NOT NULL,
    generation bigint NOT NULL,
    content_hash bytea,
    reason varchar(16) NOT NULL,
    tenant varchar(63),
    freed_at timestamptz NOT NULL,
    CONSTRAINT pk_tombstones PRIMARY KEY (instance, block_id, generation)
);
CREATE INDEX ix_tombstones_freed_at ON tombstones (freed_at);
CREATE TABLE fair_clocks (
    instance varchar(63) NOT NULL REFERENCES instances (instance),
    priority integer NOT NULL,
    virtual_time double precision DEFAULT 0 NOT NULL,
    CONSTRAINT pk_fair_clocks PRIMARY KEY (instance, priority)
);
CREATE TABLE fair_tags (
    instance varchar(63) NOT NULL REFERENCES instances (instance),
    tenant varchar(63) NOT NULL REFERENCES tenants (tenant),
    priority integer NOT NULL,
    last_finish double precision DEFAULT 0 NOT NULL,
    CONSTRAINT pk_fair_tags PRIMARY KEY (instance, tenant, priority)
);
INSERT INTO blocks (instance, block_id)
SELECT i.instance, g FROM instances i, generate_series(0, i.capacity_blocks - 1) AS g;
"""

# What the journal holds that empty per-block tables would not.
RECORDED = """
SELECT EXISTS (SELECT 1 FROM journal_slot_references)
    OR EXISTS (SELECT 1 FROM journal_slot_contents)
"""


def upgrade() -> None:
    conn = op.get_bind()
    uncarried = conn.execute(sa.text(UNCARRIED)).scalars().all()
    if uncarried:
        raise RuntimeError(
            "the per-block tables hold what the journal does not, on instances "
            + ", ".join(uncarried)
            + ": downgrade to 0022 and upgrade again to carry them into the journal first"
        )
    for table in TABLES:
        op.execute(f"DROP TABLE {table}")
    op.execute("DROP SEQUENCE block_lru")


def downgrade() -> None:
    if op.get_bind().execute(sa.text(RECORDED)).scalar_one():
        raise RuntimeError(
            "the journal holds block tables or cached slots that the per-block tables made "
            "again would not: end the reservations and pins and free the cache first"
        )
    op.execute(PER_BLOCK_TABLES)
