"""engine load as last read

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("instances", sa.Column("engine_requests_running", sa.BigInteger(), nullable=True))
    op.add_column(
        "instances", sa.Column("engine_checked_at", sa.DateTime(timezone=True), nullable=True)
    )


def downgrade() -> None:
    op.drop_column("instances", "engine_checked_at")
    op.drop_column("instances", "engine_requests_running")
