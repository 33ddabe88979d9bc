"""blocks a reclaim's end of a reservation gave back

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("reservations", sa.Column("freed_blocks", sa.Integer(), nullable=True))


def downgrade() -> None:
    op.drop_column("reservations", "freed_blocks")
