"""initial ledger: tenants, instances, reservations

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "instances",
        sa.Column("instance", sa.String(length=63), nullable=False),
        sa.Column("model", sa.String(length=200), server_default="", nullable=False),
        sa.Column("num_layers", sa.Integer(), nullable=True),
        sa.Column("num_kv_heads", sa.Integer(), nullable=True),
        sa.Column("head_dim", sa.Integer(), nullable=True),
        sa.Column("kv_dtype", sa.String(length=8), nullable=True),
        sa.Column("mla", sa.Boolean(), server_default=sa.text("false"), nullable=False),
        sa.Column("bytes_per_block", sa.BigInteger(), nullable=True),
        sa.Column("block_size", sa.Integer(), nullable=False),
        sa.Column("capacity_blocks", sa.BigInteger(), nullable=False),
        sa.Column("max_model_len", sa.Integer(), nullable=False),
        sa.Column("state", sa.String(length=16), server_default="ACTIVE", nullable=False),
        sa.Column("blocks_in_use", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("mean_hold_seconds", sa.Double(), nullable=True),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.Column(
            "updated_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.CheckConstraint("state IN ('ACTIVE', 'DRAINING')", name=op.f("ck_instances_state")),
        sa.CheckConstraint(
            "block_size >= 1 AND capacity_blocks >= 1 AND max_model_len >= 1",
            name=op.f("ck_instances_pool"),
        ),
        sa.CheckConstraint(
            "blocks_in_use BETWEEN 0 AND capacity_blocks", name=op.f("ck_instances_blocks_in_use")
        ),
        sa.PrimaryKeyConstraint("instance", name=op.f("pk_instances")),
    )
    op.create_table(
        "tenants",
        sa.Column("tenant", sa.String(length=63), nullable=False),
        sa.Column("display_name", sa.String(length=200), server_default="", nullable=False),
        sa.Column("state", sa.String(length=16), server_default="ACTIVE", nullable=False),
        sa.Column("weight", sa.Integer(), server_default="1", nullable=False),
        sa.Column("max_blocks", sa.BigInteger(), nullable=False),
        sa.Column("max_tokens_in_flight", sa.BigInteger(), nullable=False),
        sa.Column("max_queued_requests", sa.BigInteger(), nullable=False),
        sa.Column("max_pinned_blocks", sa.BigInteger(), nullable=False),
        sa.Column("max_cpu_tier_bytes", sa.BigInteger(), nullable=False),
        sa.Column("blocks_in_use", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("tokens_in_flight", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("mean_hold_seconds", sa.Double(), nullable=True),
        sa.Column("cache_salt", sa.String(length=128), nullable=False),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.Column(
            "updated_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.CheckConstraint("state IN ('ACTIVE', 'SUSPENDED')", name=op.f("ck_tenants_state")),
        sa.CheckConstraint(
            "blocks_in_use >= 0 AND tokens_in_flight >= 0",
            name=op.f("ck_tenants_usage_not_negative"),
        ),
        sa.CheckConstraint(
            "max_blocks >= 0 AND max_tokens_in_flight >= 0 AND max_queued_requests >= 0 "
            "AND max_pinned_blocks >= 0 AND max_cpu_tier_bytes >= 0",
            name=op.f("ck_tenants_quota_not_negative"),
        ),
        sa.CheckConstraint("weight >= 1", name=op.f("ck_tenants_weight")),
        sa.PrimaryKeyConstraint("tenant", name=op.f("pk_tenants")),
    )
    op.create_table(
        "reservations",
        sa.Column("tenant", sa.String(length=63), nullable=False),
        sa.Column("request_id", sa.String(length=128), nullable=False),
        sa.Column("instance", sa.String(length=63), nullable=False),
        sa.Column("prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("max_output_tokens", sa.Integer(), nullable=False),
        sa.Column("n", sa.Integer(), nullable=False),
        sa.Column("priority", sa.Integer(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("reserved_blocks", sa.BigInteger(), nullable=False),
        sa.Column("reserved_tokens", sa.BigInteger(), nullable=False),
        sa.Column("lease_ttl_seconds", sa.Double(), nullable=False),
        sa.Column("lease_expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("admitted_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("ended_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("end_reason", sa.String(length=32), nullable=True),
        sa.Column("output_tokens", sa.Integer(), nullable=True),
        sa.CheckConstraint(
            "(state = 'ADMITTED') = (ended_at IS NULL AND end_reason IS NULL)",
            name=op.f("ck_reservations_ended"),
        ),
        sa.CheckConstraint("state IN ('ADMITTED', 'ENDED')", name=op.f("ck_reservations_state")),
        sa.CheckConstraint(
            "reserved_blocks >= 0 AND reserved_tokens >= 0", name=op.f("ck_reservations_reserved")
        ),
        sa.ForeignKeyConstraint(
            ["instance"], ["instances.instance"], name=op.f("fk_reservations_instance_instances")
        ),
        sa.ForeignKeyConstraint(
            ["tenant"], ["tenants.tenant"], name=op.f("fk_reservations_tenant_tenants")
        ),
        sa.PrimaryKeyConstraint("tenant", "request_id", name=op.f("pk_reservations")),
    )
    op.create_index(
        "ix_reservations_live_instance",
        "reservations",
        ["instance", "lease_expires_at"],
        unique=False,
        postgresql_where=sa.text("state = 'ADMITTED'"),
    )
    op.create_index(
        "ix_reservations_live_lease",
        "reservations",
        ["lease_expires_at"],
        unique=False,
        postgresql_where=sa.text("state = 'ADMITTED'"),
    )
    op.create_index(
        "ix_reservations_live_tenant",
        "reservations",
        ["tenant", "lease_expires_at"],
        unique=False,
        postgresql_where=sa.text("state = 'ADMITTED'"),
    )


def downgrade() -> None:
    op.drop_index(
        "ix_reservations_live_tenant",
        table_name="reservations",
        postgresql_where=sa.text("state = 'ADMITTED'"),
    )
    op.drop_index(
        "ix_reservations_live_lease",
        table_name="reservations",
        postgresql_where=sa.text("state = 'ADMITTED'"),
    )
    op.drop_index(
        "ix_reservations_live_instance",
        table_name="reservations",
        postgresql_where=sa.text("state = 'ADMITTED'"),
    )
    op.drop_table("reservations")
    op.drop_table("tenants")
    op.drop_table("instances")
