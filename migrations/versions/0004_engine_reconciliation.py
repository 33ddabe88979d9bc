"""engine reconciliation: event hashes, drift, engine endpoints

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


# As in the models at this revision: vLLM's event hash, the digest's low 64 bits as a bigint.
EVENT_HASH = (
    "CASE WHEN content_hash IS NULL THEN NULL "
    "ELSE ('x' || encode(substring(content_hash FROM 25 FOR 8), 'hex'))::bit(64)::bigint END"
)


def upgrade() -> None:
    op.add_column(
        "blocks",
        sa.Column(
            "event_hash", sa.BigInteger(), sa.Computed(EVENT_HASH, persisted=True), nullable=True
        ),
    )
    op.add_column(
        "blocks", sa.Column("engine_confirmed_at", sa.DateTime(timezone=True), nullable=True)
    )
    op.create_index(
        "ix_blocks_event_hash",
        "blocks",
        ["instance", "event_hash"],
        unique=False,
        postgresql_where=sa.text("event_hash IS NOT NULL"),
    )
    op.add_column("instances", sa.Column("engine_url", sa.String(length=200), nullable=True))
    op.add_column(
        "instances", sa.Column("kv_events_endpoint", sa.String(length=200), nullable=True)
    )
    op.add_column(
        "instances", sa.Column("kv_replay_endpoint", sa.String(length=200), nullable=True)
    )
    op.add_column("instances", sa.Column("last_event_seq", sa.BigInteger(), nullable=True))
    op.add_column(
        "instances",
        sa.Column("engine_resyncs", sa.BigInteger(), server_default="0", nullable=False),
    )
    op.add_column(
        "instances", sa.Column("drift_blocks", sa.BigInteger(), server_default="0", nullable=False)
    )


def downgrade() -> None:
    op.drop_column("instances", "drift_blocks")
    op.drop_column("instances", "engine_resyncs")
    op.drop_column("instances", "last_event_seq")
    op.drop_column("instances", "kv_replay_endpoint")
    op.drop_column("instances", "kv_events_endpoint")
    op.drop_column("instances", "engine_url")
    op.drop_index(
        "ix_blocks_event_hash",
        table_name="blocks",
        postgresql_where=sa.text("event_hash IS NOT NULL"),
    )
    op.drop_column("blocks", "engine_confirmed_at")
    op.drop_column("blocks", "event_hash")
