"""reservations.prompt_digest: a repeated Admit with other prompt tokens is refused

Idempotency compared a repeated Admit's counts (tokens, outputs, n, priority) but not its prompt's
contents: the same request_id with other token ids was answered with the first reservation,
whose block table holds the first prompt's blocks. The SHA-256 of the token ids is kept (NULL
when none were given) and compared. Rows from before have none: a retry of one of them carrying
token ids is refused, which only matters for Admits in flight across the upgrade.

Revision ID: 0016
Revises: 0015
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("reservations", sa.Column("prompt_digest", sa.LargeBinary(), nullable=True))


def downgrade() -> None:
    op.drop_column("reservations", "prompt_digest")
