"""autovacuum for the block tables: sooner than PostgreSQL's defaults

Every Admit and Release rewrites ~96 rows of each of blocks, block_refs and tenant_blocks. With
the defaults (vacuum at 20% dead rows, analyze at 10% changed), a 1,000,000-slot pool carries up
to 200,000 dead index entries for the free-slot scan to step over, and the planner plans from
row counts up to 10% old; the hot statements are written to need no statistics, the rest of the
service's queries still do.

Revision ID: 0015
Revises: 0014
Create Date: 2026-11-29
"""

from __future__ import annotations

from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None

_TABLES = ("blocks", "block_refs", "tenant_blocks")
_SETTINGS = ("autovacuum_vacuum_scale_factor", "autovacuum_analyze_scale_factor")


def upgrade() -> None:
    for table in _TABLES:
        op.execute(f"ALTER TABLE {table} SET ({', '.join(f'{s} = 0.02' for s in _SETTINGS)})")


def downgrade() -> None:
    for table in _TABLES:
        op.execute(f"ALTER TABLE {table} RESET ({', '.join(_SETTINGS)})")
