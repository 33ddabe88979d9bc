"""cpu tier: lmcache endpoints, suspended sessions, pin tokens

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "instances", sa.Column("lmcache_coordinator_url", sa.String(length=200), nullable=True)
    )
    op.add_column(
        "instances", sa.Column("lmcache_instance_id", sa.String(length=200), nullable=True)
    )
    op.add_column(
        "instances", sa.Column("lmcache_model_name", sa.String(length=200), nullable=True)
    )
    op.add_column("instances", sa.Column("lmcache_world_size", sa.Integer(), nullable=True))
    op.add_column("instances", sa.Column("cpu_used_bytes", sa.BigInteger(), nullable=True))
    op.add_column("instances", sa.Column("cpu_capacity_bytes", sa.BigInteger(), nullable=True))
    op.add_column(
        "instances", sa.Column("cpu_checked_at", sa.DateTime(timezone=True), nullable=True)
    )
    op.add_column("pins", sa.Column("token_ids", postgresql.ARRAY(sa.Integer()), nullable=True))
    op.add_column("pins", sa.Column("chunk_keys", postgresql.ARRAY(sa.Text()), nullable=True))
    op.add_column(
        "reservations", sa.Column("suspended_at", sa.DateTime(timezone=True), nullable=True)
    )
    op.add_column("reservations", sa.Column("offloaded_bytes", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    op.drop_column("reservations", "offloaded_bytes")
    op.drop_column("reservations", "suspended_at")
    op.drop_column("pins", "chunk_keys")
    op.drop_column("pins", "token_ids")
    op.drop_column("instances", "cpu_checked_at")
    op.drop_column("instances", "cpu_capacity_bytes")
    op.drop_column("instances", "cpu_used_bytes")
    op.drop_column("instances", "lmcache_world_size")
    op.drop_column("instances", "lmcache_model_name")
    op.drop_column("instances", "lmcache_instance_id")
    op.drop_column("instances", "lmcache_coordinator_url")
