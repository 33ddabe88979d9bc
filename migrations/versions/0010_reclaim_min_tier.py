"""reclaim jobs: the lowest tier a job uses

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "reclaim_jobs",
        sa.Column("min_tier", sa.String(length=16), server_default="FREE", nullable=False),
    )
    op.create_check_constraint(
        op.f("ck_reclaim_jobs_min_tier"),
        "reclaim_jobs",
        "min_tier IN ('FREE', 'OFFLOAD', 'COMPRESS', 'EVICT')",
    )


def downgrade() -> None:
    op.drop_constraint(op.f("ck_reclaim_jobs_min_tier"), "reclaim_jobs", type_="check")
    op.drop_column("reclaim_jobs", "min_tier")
