"""Owners' leases, and tenants' quotas kept exact across owners

Several replicas share a fleet: each instance's owner holds a lease (`instance_owners.
lease_expires_at`, renewed by its owner) and another replica claims the instance only once the
lease has lapsed. Rows of earlier owners have no expiry and count as lapsed.

A tenant's quota spans instances that different replicas own, so each batch moves the tenant's
fleet-wide totals with `journal_move_totals`, which fails the batch (SQLSTATE KQ003) when a total
the batch grew ends above the tenant's quota: the row lock on the tenant orders batches of
different owners, so a quota is never over-committed. It also keeps each tenant's totals per
instance (`instance_tenant_totals`), from which an owner reads what a tenant holds on the
instances other replicas serve. It is filled from what the record holds now.

Revision ID: 0022
Revises: 0021
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0022"
down_revision = "0021"
branch_labels = None
depends_on = None

# The tenants a batch moved past their quota (in a dimension the batch grew; shadow-mode tenants
# are admitted past it on purpose) fail it, named in the message. Queued requests are bounded
# per instance, by its owner alone.
MOVE_TOTALS = """
CREATE FUNCTION journal_move_totals(p_instance text, p_moves jsonb)
RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    over text[];
BEGIN
    WITH m AS (
        SELECT * FROM jsonb_to_recordset(p_moves)
            AS m(tenant text, blocks bigint, tokens bigint, pinned bigint, queued bigint)
    ), moved AS (
        UPDATE tenants t SET blocks_in_use = t.blocks_in_use + m.blocks,
            tokens_in_flight = t.tokens_in_flight + m.tokens,
            pinned_blocks = t.pinned_blocks + m.pinned,
            queued_requests = t.queued_requests + m.queued
        FROM m WHERE t.tenant = m.tenant
        RETURNING t.tenant, NOT t.shadow_mode AND (
            (m.blocks > 0 AND t.blocks_in_use > t.max_blocks)
            OR (m.tokens > 0 AND t.tokens_in_flight > t.max_tokens_in_flight)
            OR (m.pinned > 0 AND t.pinned_blocks > t.max_pinned_blocks)) AS over_quota
    )
    SELECT array_agg(tenant ORDER BY tenant) INTO over FROM moved WHERE over_quota;
    IF over IS NOT NULL THEN
        RAISE EXCEPTION '%', array_to_string(over, ' ') USING ERRCODE = 'KQ003';
    END IF;
    INSERT INTO instance_tenant_totals AS x
        (tenant, instance, blocks_in_use, tokens_in_flight, pinned_blocks, queued_requests)
    SELECT m.tenant, p_instance, m.blocks, m.tokens, m.pinned, m.queued
    FROM jsonb_to_recordset(p_moves)
        AS m(tenant text, blocks bigint, tokens bigint, pinned bigint, queued bigint)
    ON CONFLICT (tenant, instance) DO UPDATE SET
        blocks_in_use = x.blocks_in_use + EXCLUDED.blocks_in_use,
        tokens_in_flight = x.tokens_in_flight + EXCLUDED.tokens_in_flight,
        pinned_blocks = x.pinned_blocks + EXCLUDED.pinned_blocks,
        queued_requests = x.queued_requests + EXCLUDED.queued_requests;
END
$$
"""

# What each tenant holds per instance now, from whichever layout holds it: the journal's live
# tables and pins, or the per-block ledger's tenant_blocks (a database holds one or the other);
# an offloaded session's tokens are not in flight.
FILL_TOTALS = """
INSERT INTO instance_tenant_totals
    (tenant, instance, blocks_in_use, tokens_in_flight, pinned_blocks, queued_requests)
SELECT tenant, instance, coalesce(sum(blocks), 0), coalesce(sum(tokens), 0),
       coalesce(sum(pinned), 0), coalesce(sum(queued), 0)
FROM (
    SELECT tenant, instance, count(DISTINCT block_id) AS blocks, 0 AS tokens,
           count(DISTINCT block_id) FILTER (WHERE pinned) AS pinned, 0 AS queued
    FROM journal_slot_references WHERE tenant IS NOT NULL GROUP BY tenant, instance
    UNION ALL
    SELECT tenant, instance, count(*), 0, count(*) FILTER (WHERE pin_refs > 0), 0
    FROM tenant_blocks GROUP BY tenant, instance
    UNION ALL
    SELECT tenant, instance, 0,
           sum(reserved_tokens) FILTER (WHERE state = 'ADMITTED' AND offloaded_bytes IS NULL), 0,
           count(*) FILTER (WHERE state = 'QUEUED')
    FROM reservations WHERE state IN ('ADMITTED', 'QUEUED') GROUP BY tenant, instance
) AS held
GROUP BY tenant, instance
"""


def _count(name: str) -> sa.Column[int]:
    return sa.Column(name, sa.BigInteger(), server_default="0", nullable=False)


def upgrade() -> None:
    op.create_table(
        "instance_tenant_totals",
        sa.Column("tenant", sa.String(63), nullable=False),
        sa.Column("instance", sa.String(63), nullable=False),
        _count("blocks_in_use"),
        _count("tokens_in_flight"),
        _count("pinned_blocks"),
        _count("queued_requests"),
        sa.ForeignKeyConstraint(
            ["instance"],
            ["instances.instance"],
            name="fk_instance_tenant_totals_instance_instances",
        ),
        sa.PrimaryKeyConstraint("tenant", "instance", name="pk_instance_tenant_totals"),
    )
    op.execute(FILL_TOTALS)
    op.execute(MOVE_TOTALS)


def downgrade() -> None:
    op.execute("DROP FUNCTION journal_move_totals(text, jsonb)")
    op.drop_table("instance_tenant_totals")
