"""The COMPRESSED tier: a suspended session demoted from the CPU tier's L1 to its compressing L2

A COMPRESS step measures the session's chunks in LMCache before it demotes them (kept on the
step: reclaim_steps.bytes_before, bytes_after, bytes_kept), then books the session in the
compressed tier (reservations.compressed_bytes, and the measured compress_before_bytes and
compress_after_bytes); each instance keeps the last ratio measured there
(instances.cpu_compression_ratio) for its plans. Usage meters compressed bytes beside CPU-tier
bytes (usage_events.compressed_bytes; usage_hours.compressed_byte_us, end_compressed_bytes).
Nothing was ever compressed before: existing rows get NULL and zeros.

Revision ID: 0020
Revises: 0019
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None

COMPRESSED_CHECK = (
    "compressed_bytes IS NULL OR (offloaded_bytes IS NOT NULL "
    "AND compress_before_bytes > 0 AND compress_after_bytes >= 0)"
)


def upgrade() -> None:
    op.add_column("instances", sa.Column("cpu_compression_ratio", sa.Double(), nullable=True))
    for column in ("compressed_bytes", "compress_before_bytes", "compress_after_bytes"):
        op.add_column("reservations", sa.Column(column, sa.BigInteger(), nullable=True))
    op.create_check_constraint(op.f("ck_reservations_compressed"), "reservations", COMPRESSED_CHECK)
    for column in ("bytes_before", "bytes_after", "bytes_kept"):
        op.add_column("reclaim_steps", sa.Column(column, sa.BigInteger(), nullable=True))
    # Constant defaults: PostgreSQL adds these columns without rewriting the tables.
    op.add_column(
        "usage_events",
        sa.Column("compressed_bytes", sa.BigInteger(), nullable=False, server_default="0"),
    )
    op.add_column(
        "usage_hours",
        sa.Column("compressed_byte_us", sa.Numeric(38, 0), nullable=False, server_default="0"),
    )
    op.add_column(
        "usage_hours",
        sa.Column("end_compressed_bytes", sa.BigInteger(), nullable=False, server_default="0"),
    )


def downgrade() -> None:
    op.drop_column("usage_hours", "end_compressed_bytes")
    op.drop_column("usage_hours", "compressed_byte_us")
    op.drop_column("usage_events", "compressed_bytes")
    for column in ("bytes_kept", "bytes_after", "bytes_before"):
        op.drop_column("reclaim_steps", column)
    op.drop_constraint(op.f("ck_reservations_compressed"), "reservations", type_="check")
    for column in ("compress_after_bytes", "compress_before_bytes", "compressed_bytes"):
        op.drop_column("reservations", column)
    op.drop_column("instances", "cpu_compression_ratio")
