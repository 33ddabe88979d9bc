"""hot path: no foreign keys on block_refs and tenant_blocks

Their rows are written only under the instance's and tenant's row locks, with keys copied from
a reservation or pin whose own foreign keys stand, and instances and tenants are never deleted.
The per-row checks were four trigger calls per block of every Admit (384 for a 96-block request).

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-29
"""

from __future__ import annotations

from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None

_DROPPED = (
    ("block_refs", "instance", "instances"),
    ("block_refs", "tenant", "tenants"),
    ("tenant_blocks", "tenant", "tenants"),
    ("tenant_blocks", "instance", "instances"),
)


def upgrade() -> None:
    for table, column, referred in _DROPPED:
        op.drop_constraint(op.f(f"fk_{table}_{column}_{referred}"), table, type_="foreignkey")


def downgrade() -> None:
    for table, column, referred in _DROPPED:
        op.create_foreign_key(
            op.f(f"fk_{table}_{column}_{referred}"), table, referred, [column], [column]
        )
