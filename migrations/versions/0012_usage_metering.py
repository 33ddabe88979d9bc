"""usage metering: events, closed hours

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "usage_closed_hours",
        sa.Column("hour", sa.DateTime(timezone=True), nullable=False),
        sa.Column(
            "closed_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False
        ),
        sa.Column("events", sa.BigInteger(), nullable=False),
        sa.Column("late_events", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("hour", name=op.f("pk_usage_closed_hours")),
    )
    op.create_table(
        "usage_events",
        sa.Column("id", sa.BigInteger(), autoincrement=True, nullable=False),
        sa.Column(
            "at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False
        ),
        sa.Column("tenant", sa.String(length=63), nullable=False),
        sa.Column("instance", sa.String(length=63), nullable=False),
        sa.Column(
            "blocks",
            postgresql.JSONB(astext_type=sa.Text()),
            server_default=sa.text("'{}'::jsonb"),
            nullable=False,
        ),
        sa.Column("pinned", sa.Integer(), server_default="0", nullable=False),
        sa.Column("cpu_bytes", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("tokens_reserved", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("output_tokens", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("admitted", sa.Integer(), server_default="0", nullable=False),
        sa.Column("queued", sa.Integer(), server_default="0", nullable=False),
        sa.Column(
            "refused",
            postgresql.JSONB(astext_type=sa.Text()),
            server_default=sa.text("'{}'::jsonb"),
            nullable=False,
        ),
        sa.Column(
            "reclaimed",
            postgresql.JSONB(astext_type=sa.Text()),
            server_default=sa.text("'{}'::jsonb"),
            nullable=False,
        ),
        sa.Column("hour", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_usage_events")),
    )
    op.create_index(
        "ix_usage_events_open",
        "usage_events",
        ["at"],
        unique=False,
        postgresql_where=sa.text("hour IS NULL"),
    )
    op.create_table(
        "usage_hours",
        sa.Column("hour", sa.DateTime(timezone=True), nullable=False),
        sa.Column("tenant", sa.String(length=63), nullable=False),
        sa.Column("instance", sa.String(length=63), nullable=False),
        sa.Column("block_us", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("pinned_block_us", sa.BigInteger(), nullable=False),
        sa.Column("cpu_byte_us", sa.Numeric(precision=38, scale=0), nullable=False),
        sa.Column("tokens_reserved", sa.BigInteger(), nullable=False),
        sa.Column("output_tokens", sa.BigInteger(), nullable=False),
        sa.Column("admitted", sa.BigInteger(), nullable=False),
        sa.Column("queued", sa.BigInteger(), nullable=False),
        sa.Column("refused", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("reclaimed", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("bytes_per_block", sa.BigInteger(), nullable=True),
        sa.Column("end_blocks", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("end_pinned", sa.BigInteger(), nullable=False),
        sa.Column("end_cpu_bytes", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("hour", "tenant", "instance", name=op.f("pk_usage_hours")),
    )
    op.create_index(
        "ix_tenant_blocks_instance_block_id",
        "tenant_blocks",
        ["instance", "block_id"],
        unique=False,
    )


def downgrade() -> None:
    op.drop_index("ix_tenant_blocks_instance_block_id", table_name="tenant_blocks")
    op.drop_table("usage_hours")
    op.drop_index(
        "ix_usage_events_open", table_name="usage_events", postgresql_where=sa.text("hour IS NULL")
    )
    op.drop_table("usage_events")
    op.drop_table("usage_closed_hours")
