"""Shadow mode: tenants.shadow_mode, what it let through, per reservation and in usage

For rolling kvquota out in front of live traffic: a tenant in shadow mode is admitted where its
own limits would refuse it, and the reason is kept on the reservation and counted in usage
(usage_events, then usage_hours) next to real refusals. Existing rows were never admitted in
shadow mode: false, NULL and empty counts.

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None

NO_COUNTS = sa.text("'{}'::jsonb")


def upgrade() -> None:
    # Constant defaults: PostgreSQL adds these columns without rewriting the tables.
    op.add_column(
        "tenants",
        sa.Column("shadow_mode", sa.Boolean(), nullable=False, server_default=sa.text("false")),
    )
    op.add_column("reservations", sa.Column("shadow_refusal", sa.String(32), nullable=True))
    for table in ("usage_events", "usage_hours"):
        op.add_column(
            table, sa.Column("shadow_refused", JSONB(), nullable=False, server_default=NO_COUNTS)
        )


def downgrade() -> None:
    for table in ("usage_events", "usage_hours"):
        op.drop_column(table, "shadow_refused")
    op.drop_column("reservations", "shadow_refusal")
    op.drop_column("tenants", "shadow_mode")
