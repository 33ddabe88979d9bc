"""reclaim jobs

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "reclaim_jobs",
        sa.Column("job_id", sa.String(length=63), nullable=False),
        sa.Column("request_id", sa.String(length=128), nullable=False),
        sa.Column("instance", sa.String(length=63), nullable=False),
        sa.Column("tenant", sa.String(length=63), nullable=True),
        sa.Column("target_blocks", sa.BigInteger(), nullable=False),
        sa.Column("max_tier", sa.String(length=16), nullable=False),
        sa.Column("dry_run", sa.Boolean(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("expected_blocks", sa.BigInteger(), nullable=False),
        sa.Column("excluded", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint(
            "max_tier IN ('FREE', 'OFFLOAD', 'COMPRESS', 'EVICT')",
            name=op.f("ck_reclaim_jobs_max_tier"),
        ),
        sa.CheckConstraint(
            "state IN ('PLANNED', 'RUNNING', 'SUCCEEDED', 'FAILED', 'CANCELLED')",
            name=op.f("ck_reclaim_jobs_state"),
        ),
        sa.ForeignKeyConstraint(
            ["instance"], ["instances.instance"], name=op.f("fk_reclaim_jobs_instance_instances")
        ),
        sa.ForeignKeyConstraint(
            ["tenant"], ["tenants.tenant"], name=op.f("fk_reclaim_jobs_tenant_tenants")
        ),
        sa.PrimaryKeyConstraint("job_id", name=op.f("pk_reclaim_jobs")),
        sa.UniqueConstraint("request_id", name=op.f("uq_reclaim_jobs_request_id")),
    )
    op.create_index(
        "ix_reclaim_jobs_open",
        "reclaim_jobs",
        ["created_at"],
        unique=False,
        postgresql_where=sa.text("state IN ('PLANNED', 'RUNNING')"),
    )
    op.create_table(
        "reclaim_steps",
        sa.Column("job_id", sa.String(length=63), nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("tier", sa.String(length=16), nullable=False),
        sa.Column("block_id", sa.Integer(), nullable=True),
        sa.Column("generation", sa.BigInteger(), nullable=True),
        sa.Column("tenant", sa.String(length=63), nullable=True),
        sa.Column("request_id", sa.String(length=128), nullable=True),
        sa.Column("expected_blocks", sa.Integer(), nullable=False),
        sa.Column("cpu_bytes", sa.BigInteger(), nullable=False),
        sa.Column("lossy", sa.Boolean(), nullable=False),
        sa.Column("state", sa.String(length=16), server_default="PLANNED", nullable=False),
        sa.Column("actual_blocks", sa.Integer(), nullable=True),
        sa.Column("note", sa.String(length=200), nullable=True),
        sa.Column("applied_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint(
            "state IN ('PLANNED', 'APPLIED', 'SKIPPED', 'FAILED')",
            name=op.f("ck_reclaim_steps_state"),
        ),
        sa.CheckConstraint(
            "tier IN ('FREE', 'OFFLOAD', 'COMPRESS', 'EVICT')", name=op.f("ck_reclaim_steps_tier")
        ),
        sa.ForeignKeyConstraint(
            ["job_id"],
            ["reclaim_jobs.job_id"],
            name=op.f("fk_reclaim_steps_job_id_reclaim_jobs"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("job_id", "seq", name=op.f("pk_reclaim_steps")),
    )


def downgrade() -> None:
    op.drop_table("reclaim_steps")
    op.drop_index(
        "ix_reclaim_jobs_open",
        table_name="reclaim_jobs",
        postgresql_where=sa.text("state IN ('PLANNED', 'RUNNING')"),
    )
    op.drop_table("reclaim_jobs")
