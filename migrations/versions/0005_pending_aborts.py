"""release follows the engine: pending aborts

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "reservations", sa.Column("abort_requested_at", sa.DateTime(timezone=True), nullable=True)
    )
    op.add_column("reservations", sa.Column("abort_reason", sa.String(length=32), nullable=True))
    op.create_index(
        "ix_reservations_abort_pending",
        "reservations",
        ["abort_requested_at"],
        postgresql_where=sa.text("abort_requested_at IS NOT NULL AND state = 'ADMITTED'"),
    )


def downgrade() -> None:
    op.drop_index("ix_reservations_abort_pending", table_name="reservations")
    op.drop_column("reservations", "abort_reason")
    op.drop_column("reservations", "abort_requested_at")
