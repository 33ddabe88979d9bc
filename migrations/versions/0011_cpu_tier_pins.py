"""cpu tier pins: an outbox per pin

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "cpu_tier_pins",
        sa.Column("holder_id", sa.BigInteger(), nullable=False),
        sa.Column("coordinator_url", sa.String(length=200), nullable=False),
        sa.Column("model_name", sa.String(length=200), nullable=False),
        sa.Column("world_size", sa.Integer(), nullable=False),
        sa.Column("cache_salt", sa.String(length=128), nullable=False),
        sa.Column("token_ids", postgresql.ARRAY(sa.Integer()), nullable=False),
        sa.Column("chunk_keys", postgresql.ARRAY(sa.Text()), nullable=True),
        sa.Column("wanted", sa.Boolean(), server_default=sa.text("true"), nullable=False),
        sa.PrimaryKeyConstraint("holder_id", name=op.f("pk_cpu_tier_pins")),
    )
    op.create_index(
        "ix_cpu_tier_pins_coordinator_url", "cpu_tier_pins", ["coordinator_url"], unique=False
    )
    op.drop_column("pins", "token_ids")
    op.drop_column("pins", "chunk_keys")


def downgrade() -> None:
    op.add_column(
        "pins",
        sa.Column("chunk_keys", postgresql.ARRAY(sa.TEXT()), autoincrement=False, nullable=True),
    )
    op.add_column(
        "pins",
        sa.Column("token_ids", postgresql.ARRAY(sa.INTEGER()), autoincrement=False, nullable=True),
    )
    op.drop_index("ix_cpu_tier_pins_coordinator_url", table_name="cpu_tier_pins")
    op.drop_table("cpu_tier_pins")
