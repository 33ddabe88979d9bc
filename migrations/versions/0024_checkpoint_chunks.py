"""A checkpoint in chunks

An instance's checkpoint (every slot holding a hash, as of a batch) was one row: for a pool of
1,000,000 slots, one statement of about 60 MB that its owner built whole in memory. It is now
rows of a bounded number of slots each (`chunk` numbers them from 0), which the owner builds and
sends one at a time within the batch's transaction. The rows there are become chunk 0.

Revision ID: 0024
Revises: 0023
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0024"
down_revision = "0023"
branch_labels = None
depends_on = None

# Chunks after the first fold back into it: one row per instance again.
_FOLD = """
UPDATE pool_checkpoints c SET slots = f.slots, generations = f.generations,
    digests = f.digests, scope_ids = f.scope_ids, engine_copies = f.engine_copies,
    lru_seqs = f.lru_seqs
FROM (
    SELECT instance, array_agg(s.slot ORDER BY chunk, s.n) AS slots,
           array_agg(s.generation ORDER BY chunk, s.n) AS generations,
           string_agg(substring(digests FROM (s.n::int - 1) * 32 + 1 FOR 32), ''::bytea
                      ORDER BY chunk, s.n) AS digests,
           array_agg(s.scope_id ORDER BY chunk, s.n) AS scope_ids,
           array_agg(s.copies ORDER BY chunk, s.n) AS engine_copies,
           array_agg(s.lru_seq ORDER BY chunk, s.n) AS lru_seqs
    FROM pool_checkpoints,
         unnest(slots, generations, scope_ids, engine_copies, lru_seqs)
             WITH ORDINALITY AS s(slot, generation, scope_id, copies, lru_seq, n)
    WHERE instance IN (SELECT instance FROM pool_checkpoints WHERE chunk > 0)
    GROUP BY instance
) AS f
WHERE c.instance = f.instance AND c.chunk = 0
"""


def upgrade() -> None:
    op.add_column(
        "pool_checkpoints", sa.Column("chunk", sa.Integer(), server_default="0", nullable=False)
    )
    op.drop_constraint("pk_pool_checkpoints", "pool_checkpoints", type_="primary")
    op.create_primary_key("pk_pool_checkpoints", "pool_checkpoints", ["instance", "chunk"])


def downgrade() -> None:
    op.execute(_FOLD)
    op.execute("DELETE FROM pool_checkpoints WHERE chunk > 0")
    op.drop_constraint("pk_pool_checkpoints", "pool_checkpoints", type_="primary")
    op.create_primary_key("pk_pool_checkpoints", "pool_checkpoints", ["instance"])
    op.drop_column("pool_checkpoints", "chunk")
