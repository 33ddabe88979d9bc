"""blocks.engine_copies: how many copies of a block's contents the engine reports holding

vLLM does not de-duplicate identical blocks: the same hash may be stored twice, and a BlockRemoved
then removes one copy. The ledger freed its block at the first removal while the engine still
held the other. GPU copies are counted from the events (ENGINES.md: count per instance, hash and
medium); a block's contents are dropped when the last copy goes.

Revision ID: 0017
Revises: 0016
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # A constant default: PostgreSQL adds the column without rewriting the table.
    op.add_column(
        "blocks",
        sa.Column("engine_copies", sa.Integer(), nullable=False, server_default="0"),
    )


def downgrade() -> None:
    op.drop_column("blocks", "engine_copies")
