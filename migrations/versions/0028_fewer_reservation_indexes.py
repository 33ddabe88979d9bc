"""Reservations keep two indexes instead of eight, and the journal's rows no foreign keys

The journal writes a reservation's row when it is admitted or queued and again when it ends,
and each index whose predicate the row meets costs PostgreSQL an entry on every such write:
an admitted row went into five (its key, `holder_id`'s, and three of the live ones), an ended
one into two. The six partial indexes were the per-block ledger's: its reaper, queue dispatch
and abort scans read reservations by lease, queue order, wait deadline and abort time. Those
decisions are the owners' now, taken in memory; what still reads live reservations from the
record (an owner's recovery and reconciliation, the abort loop, offboarding, reclaim, the
invariant checks) reads a few thousand rows at most, which one index over the live rows by
instance serves. `holder_id` named a reservation in the per-block ledger's references; it
stays as an admission-order tie-break but needs no unique index.

The foreign keys of the rows every batch writes (a reservation's tenant and instance, a pool
delta's instance) checked each row against its tenant's and instance's rows and locked those
rows (FOR KEY SHARE) in every batch, which the batch then updates (the tenant's totals, the
instance's counters). What they guarded, the owner checks before the batch: it admits only for
tenants it knows, on the instance it owns, and neither tenants nor instances are ever deleted
(offboarding marks a tenant DELETED).

Revision ID: 0028
Revises: 0027
Create Date: 2026-12-07
"""

from __future__ import annotations

from alembic import op

revision = "0028"
down_revision = "0027"
branch_labels = None
depends_on = None

# name: (columns, predicate) as 0001..0005 made them.
DROPPED = {
    "ix_reservations_queue": (
        "instance, priority DESC, virtual_start, queued_at",
        "state = 'QUEUED'",
    ),
    "ix_reservations_abort_pending": (
        "abort_requested_at",
        "abort_requested_at IS NOT NULL AND state = 'ADMITTED'",
    ),
    "ix_reservations_wait_deadline": ("wait_deadline", "state = 'QUEUED'"),
    "ix_reservations_live_lease": ("lease_expires_at", "state = 'ADMITTED'"),
    "ix_reservations_live_instance": ("instance, lease_expires_at", "state = 'ADMITTED'"),
    "ix_reservations_live_tenant": ("tenant, lease_expires_at", "state = 'ADMITTED'"),
}
LIVE = "ix_reservations_live"
# (table, column, referenced table) of the foreign keys dropped.
FOREIGN_KEYS = (
    ("reservations", "tenant", "tenants"),
    ("reservations", "instance", "instances"),
    ("pool_deltas", "instance", "instances"),
)


def _foreign_key(table: str, column: str, referenced: str) -> str:
    return f"fk_{table}_{column}_{referenced}"


def upgrade() -> None:
    for name in DROPPED:
        op.execute(f"DROP INDEX {name}")
    op.execute("ALTER TABLE reservations DROP CONSTRAINT uq_reservations_holder_id")
    op.execute(
        f"CREATE INDEX {LIVE} ON reservations (instance) WHERE state IN ('QUEUED', 'ADMITTED')"
    )
    for table, column, referenced in FOREIGN_KEYS:
        op.execute(f"ALTER TABLE {table} DROP CONSTRAINT {_foreign_key(table, column, referenced)}")


def downgrade() -> None:
    for table, column, referenced in FOREIGN_KEYS:
        op.execute(
            f"ALTER TABLE {table} ADD CONSTRAINT {_foreign_key(table, column, referenced)} "
            f"FOREIGN KEY ({column}) REFERENCES {referenced} ({column})"
        )
    op.execute(f"DROP INDEX {LIVE}")
    op.execute(
        "ALTER TABLE reservations ADD CONSTRAINT uq_reservations_holder_id UNIQUE (holder_id)"
    )
    for name, (columns, predicate) in DROPPED.items():
        op.execute(f"CREATE INDEX {name} ON reservations ({columns}) WHERE {predicate}")
