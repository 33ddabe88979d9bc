"""Each tenant's fair-queueing clocks on an instance live in its row of `instance_tenant_totals`,
not in the owner's row

An owner kept every tenant's finish tags and mean holding time as a `tenants/<tenant>` key of
`instance_owners.clocks`, and every batch merged its tenants' keys into that one jsonb value,
which PostgreSQL reads and writes whole: with 3,000 tenants each served once on an instance
(about 50 kB of clocks), a one-operation batch cost PostgreSQL 13 ms of CPU instead of 1. The
clocks now go with the tenant's totals on the instance, which the batch writes anyway, and the
owner's row keeps only the instance's own scalars (virtual times, mean holding time, drift).

The rows' key leads with the instance (it led with the tenant), so that a new owner reads its
instance's rows by key rather than all rows of the fleet.

The upgrade moves each `tenants/` key into its tenant's row (making the row, with nothing held,
where there was none) and strips it from the owner's row; the downgrade puts the clocks back.

Revision ID: 0029
Revises: 0028
Create Date: 2026-12-07
"""

from __future__ import annotations

from alembic import op

revision = "0029"
down_revision = "0028"
branch_labels = None
depends_on = None

ADD_COLUMNS = (
    "ALTER TABLE instance_tenant_totals ADD COLUMN last_finish jsonb NOT NULL DEFAULT '{}', "
    "ADD COLUMN mean_hold_seconds double precision"
)
DROP_COLUMNS = (
    "ALTER TABLE instance_tenant_totals DROP COLUMN last_finish, DROP COLUMN mean_hold_seconds"
)


def _key(columns: str) -> str:
    return (
        "ALTER TABLE instance_tenant_totals DROP CONSTRAINT pk_instance_tenant_totals, "
        f"ADD CONSTRAINT pk_instance_tenant_totals PRIMARY KEY ({columns})"
    )


# What the owners' rows keep of each tenant, moved into the tenants' rows.
TO_TENANT_ROWS = """
INSERT INTO instance_tenant_totals AS x (tenant, instance, blocks_in_use, tokens_in_flight,
    pinned_blocks, queued_requests, last_finish, mean_hold_seconds)
SELECT substr(c.key, length('tenants/') + 1), o.instance, 0, 0, 0, 0,
    coalesce(nullif(c.value -> 'last_finish', 'null'), '{}'),
    CAST(c.value ->> 'mean_hold_seconds' AS float8)
FROM instance_owners o, jsonb_each(o.clocks) AS c
WHERE c.key LIKE 'tenants/%'
ON CONFLICT (tenant, instance) DO UPDATE SET last_finish = EXCLUDED.last_finish,
    mean_hold_seconds = EXCLUDED.mean_hold_seconds
"""
STRIP_OWNER_ROWS = """
UPDATE instance_owners SET clocks = clocks - ARRAY(
    SELECT k FROM jsonb_object_keys(clocks) AS k WHERE k LIKE 'tenants/%')
WHERE EXISTS (SELECT 1 FROM jsonb_object_keys(clocks) AS k WHERE k LIKE 'tenants/%')
"""

# The tenants' clocks back into their owners' rows, as a `tenants/` key for each tenant's row.
TO_OWNER_ROWS = """
UPDATE instance_owners o SET clocks = o.clocks || c.tenants
FROM (
    SELECT instance, jsonb_object_agg('tenants/' || tenant, jsonb_build_object(
        'last_finish', last_finish, 'mean_hold_seconds', mean_hold_seconds)) AS tenants
    FROM instance_tenant_totals GROUP BY instance
) AS c
WHERE c.instance = o.instance
"""


def upgrade() -> None:
    op.execute(_key("instance, tenant"))
    op.execute(ADD_COLUMNS)
    op.execute(TO_TENANT_ROWS)
    op.execute(STRIP_OWNER_ROWS)


def downgrade() -> None:
    op.execute(TO_OWNER_ROWS)
    op.execute(DROP_COLUMNS)
    op.execute(_key("tenant, instance"))
