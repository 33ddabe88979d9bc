"""block pool shadow: blocks, block tables, pins, namespaces, tombstones

Every instance gets one row per block slot. Reservations admitted before this revision had no
block tables: each gets private blocks for what it reserved, so every invariant holds afterwards.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29
"""

from __future__ import annotations

import sys

import sqlalchemy as sa
from alembic import op
from sqlalchemy.schema import CreateSequence, DropSequence, Sequence

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


SEQUENCES = (Sequence("holder_ids"), Sequence("block_lru"))
# As in 0002's models; a later revision that changes it must say so itself.
BLOCK_STATE = (
    "CASE WHEN ref_count = 0 AND content_hash IS NULL THEN 'FREE' "
    "WHEN ref_count = 0 THEN 'CACHED' "
    "WHEN ref_count = pin_count THEN 'PINNED' ELSE 'IN_USE' END"
)


def upgrade() -> None:
    for sequence in SEQUENCES:
        op.execute(CreateSequence(sequence))
    op.create_table(
        "namespaces",
        sa.Column("namespace", sa.String(length=63), nullable=False),
        sa.Column("cache_salt", sa.String(length=128), nullable=False),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.PrimaryKeyConstraint("namespace", name=op.f("pk_namespaces")),
    )
    op.create_table(
        "tombstones",
        sa.Column("instance", sa.String(length=63), nullable=False),
        sa.Column("block_id", sa.Integer(), nullable=False),
        sa.Column("generation", sa.BigInteger(), nullable=False),
        sa.Column("content_hash", sa.LargeBinary(), nullable=True),
        sa.Column("reason", sa.String(length=16), nullable=False),
        sa.Column("tenant", sa.String(length=63), nullable=True),
        sa.Column("freed_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("instance", "block_id", "generation", name=op.f("pk_tombstones")),
    )
    op.create_index("ix_tombstones_freed_at", "tombstones", ["freed_at"], unique=False)
    op.create_table(
        "blocks",
        sa.Column("instance", sa.String(length=63), nullable=False),
        sa.Column("block_id", sa.Integer(), nullable=False),
        sa.Column("generation", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("ref_count", sa.Integer(), server_default="0", nullable=False),
        sa.Column("pin_count", sa.Integer(), server_default="0", nullable=False),
        sa.Column("content_hash", sa.LargeBinary(), nullable=True),
        sa.Column("hash_scope", sa.String(length=80), nullable=True),
        sa.Column("tier", sa.String(length=16), server_default="GPU", nullable=False),
        sa.Column("lru_seq", sa.BigInteger(), nullable=True),
        sa.Column("last_used_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column(
            "state",
            sa.String(length=8),
            sa.Computed(BLOCK_STATE, persisted=True),
            nullable=False,
        ),
        sa.CheckConstraint("tier IN ('GPU', 'CPU', 'COMPRESSED')", name=op.f("ck_blocks_tier")),
        sa.CheckConstraint(
            "pin_count >= 0 AND ref_count >= pin_count", name=op.f("ck_blocks_refs")
        ),
        sa.ForeignKeyConstraint(
            ["instance"], ["instances.instance"], name=op.f("fk_blocks_instance_instances")
        ),
        sa.PrimaryKeyConstraint("instance", "block_id", name=op.f("pk_blocks")),
    )
    op.create_index(
        "ix_blocks_cached_lru",
        "blocks",
        ["instance", "lru_seq"],
        unique=False,
        postgresql_where=sa.text("state = 'CACHED'"),
    )
    op.create_index(
        "ix_blocks_free",
        "blocks",
        ["instance", "block_id"],
        unique=False,
        postgresql_where=sa.text("state = 'FREE'"),
    )
    op.create_index(
        "ix_blocks_hash",
        "blocks",
        ["instance", "content_hash"],
        unique=False,
        postgresql_where=sa.text("content_hash IS NOT NULL"),
    )
    op.create_table(
        "block_refs",
        sa.Column("holder_id", sa.BigInteger(), nullable=False),
        sa.Column("position", sa.Integer(), nullable=False),
        sa.Column("instance", sa.String(length=63), nullable=False),
        sa.Column("block_id", sa.Integer(), nullable=False),
        sa.Column("generation", sa.BigInteger(), nullable=False),
        sa.Column("tenant", sa.String(length=63), nullable=True),
        sa.Column("pinned", sa.Boolean(), nullable=False),
        sa.Column("released", sa.Boolean(), server_default=sa.text("false"), nullable=False),
        sa.ForeignKeyConstraint(
            ["instance"], ["instances.instance"], name=op.f("fk_block_refs_instance_instances")
        ),
        sa.ForeignKeyConstraint(
            ["tenant"], ["tenants.tenant"], name=op.f("fk_block_refs_tenant_tenants")
        ),
        sa.PrimaryKeyConstraint("holder_id", "position", name=op.f("pk_block_refs")),
    )
    op.create_index(
        "ix_block_refs_block",
        "block_refs",
        ["instance", "block_id"],
        unique=False,
        postgresql_where=sa.text("NOT released"),
    )
    op.create_table(
        "pins",
        sa.Column(
            "holder_id",
            sa.BigInteger(),
            server_default=sa.text("nextval('holder_ids')"),
            nullable=False,
        ),
        sa.Column("owner", sa.String(length=80), nullable=False),
        sa.Column("pin_id", sa.String(length=63), nullable=False),
        sa.Column("tenant", sa.String(length=63), nullable=True),
        sa.Column("instance", sa.String(length=63), nullable=False),
        sa.Column("prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("pinned_blocks", sa.Integer(), nullable=False),
        sa.Column("prefix_hash", sa.LargeBinary(), nullable=False),
        sa.Column("state", sa.String(length=16), server_default="ACTIVE", nullable=False),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.Column("removed_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint("state IN ('ACTIVE', 'REMOVED')", name=op.f("ck_pins_state")),
        sa.ForeignKeyConstraint(
            ["instance"], ["instances.instance"], name=op.f("fk_pins_instance_instances")
        ),
        sa.ForeignKeyConstraint(
            ["tenant"], ["tenants.tenant"], name=op.f("fk_pins_tenant_tenants")
        ),
        sa.PrimaryKeyConstraint("holder_id", name=op.f("pk_pins")),
    )
    op.create_index("uq_pins_owner_pin_id", "pins", ["owner", "pin_id"], unique=True)
    op.create_table(
        "tenant_blocks",
        sa.Column("tenant", sa.String(length=63), nullable=False),
        sa.Column("instance", sa.String(length=63), nullable=False),
        sa.Column("block_id", sa.Integer(), nullable=False),
        sa.Column("generation", sa.BigInteger(), nullable=False),
        sa.Column("refs", sa.Integer(), nullable=False),
        sa.Column("pin_refs", sa.Integer(), nullable=False),
        sa.CheckConstraint(
            "refs > 0 AND pin_refs BETWEEN 0 AND refs", name=op.f("ck_tenant_blocks_refs")
        ),
        sa.ForeignKeyConstraint(
            ["instance"], ["instances.instance"], name=op.f("fk_tenant_blocks_instance_instances")
        ),
        sa.ForeignKeyConstraint(
            ["tenant"], ["tenants.tenant"], name=op.f("fk_tenant_blocks_tenant_tenants")
        ),
        sa.PrimaryKeyConstraint("tenant", "instance", "block_id", name=op.f("pk_tenant_blocks")),
    )
    op.add_column(
        "instances",
        sa.Column("hash_algo", sa.String(length=16), server_default="sha256", nullable=False),
    )
    op.add_column(
        "instances", sa.Column("free_blocks", sa.BigInteger(), server_default="0", nullable=False)
    )
    op.add_column(
        "instances", sa.Column("cached_blocks", sa.BigInteger(), server_default="0", nullable=False)
    )
    op.add_column(
        "instances", sa.Column("pinned_blocks", sa.BigInteger(), server_default="0", nullable=False)
    )
    op.add_column(
        "reservations",
        sa.Column(
            "holder_id",
            sa.BigInteger(),
            server_default=sa.text("nextval('holder_ids')"),
            nullable=False,
        ),
    )
    op.add_column(
        "reservations",
        sa.Column("prefix_hit_blocks", sa.Integer(), server_default="0", nullable=False),
    )
    op.create_unique_constraint(op.f("uq_reservations_holder_id"), "reservations", ["holder_id"])
    op.add_column(
        "tenants", sa.Column("pinned_blocks", sa.BigInteger(), server_default="0", nullable=False)
    )
    op.add_column("tenants", sa.Column("namespace", sa.String(length=63), nullable=True))
    op.add_column(
        "tenants",
        sa.Column("offboard_freed_blocks", sa.BigInteger(), server_default="0", nullable=False),
    )
    op.add_column(
        "tenants",
        sa.Column("offboard_shared_blocks", sa.BigInteger(), server_default="0", nullable=False),
    )
    op.add_column(
        "tenants",
        sa.Column("offboard_pinned_by_others", sa.BigInteger(), server_default="0", nullable=False),
    )
    op.create_foreign_key(
        op.f("fk_tenants_namespace_namespaces"),
        "tenants",
        "namespaces",
        ["namespace"],
        ["namespace"],
    )
    _fill_block_pools()
    op.drop_constraint(op.f("ck_instances_blocks_in_use"), "instances", type_="check")
    op.create_check_constraint(
        op.f("ck_instances_hash_algo"), "instances", "hash_algo IN ('sha256', 'sha256_cbor')"
    )
    op.create_check_constraint(
        op.f("ck_instances_block_states"),
        "instances",
        "free_blocks >= 0 AND cached_blocks >= 0 AND blocks_in_use >= 0 AND pinned_blocks >= 0 "
        "AND free_blocks + cached_blocks + blocks_in_use + pinned_blocks = capacity_blocks",
    )
    op.drop_constraint(op.f("ck_tenants_state"), "tenants", type_="check")
    op.create_check_constraint(
        op.f("ck_tenants_state"),
        "tenants",
        "state IN ('ACTIVE', 'SUSPENDED', 'DELETING', 'DELETED')",
    )
    op.drop_constraint(op.f("ck_tenants_usage_not_negative"), "tenants", type_="check")
    op.create_check_constraint(
        op.f("ck_tenants_usage_not_negative"),
        "tenants",
        "blocks_in_use >= 0 AND tokens_in_flight >= 0 AND pinned_blocks >= 0",
    )


def _fill_block_pools() -> None:
    connection = op.get_bind()
    instances = connection.execute(
        sa.text("SELECT instance, capacity_blocks FROM instances ORDER BY instance")
    ).all()
    for number, (instance, capacity) in enumerate(instances, 1):
        # Progress on stderr: a pool of a million slots takes seconds.
        print(
            f"0002: block pool {number}/{len(instances)}: {instance}, {capacity} slots",
            file=sys.stderr,
        )
        connection.execute(
            sa.text(
                "INSERT INTO blocks (instance, block_id) "
                "SELECT :instance, g FROM generate_series(0, :capacity - 1) AS g"
            ),
            {"instance": instance, "capacity": capacity},
        )
    connection.execute(
        sa.text(
            """
            WITH live AS (
                SELECT holder_id, tenant, instance, reserved_blocks,
                       sum(reserved_blocks) OVER (
                           PARTITION BY instance ORDER BY admitted_at, tenant, request_id
                       ) - reserved_blocks AS first_block
                FROM reservations WHERE state = 'ADMITTED'
            )
            INSERT INTO block_refs (
                holder_id, position, instance, block_id, generation, tenant, pinned)
            SELECT holder_id, p, instance, first_block + p, 0, tenant, false
            FROM live, generate_series(0, reserved_blocks - 1) AS p
            """
        )
    )
    connection.execute(
        sa.text(
            "UPDATE blocks b SET ref_count = 1, last_used_at = now() FROM block_refs r "
            "WHERE r.instance = b.instance AND r.block_id = b.block_id"
        )
    )
    connection.execute(
        sa.text(
            "INSERT INTO tenant_blocks (tenant, instance, block_id, generation, refs, pin_refs) "
            "SELECT tenant, instance, block_id, 0, 1, 0 FROM block_refs"
        )
    )
    connection.execute(
        sa.text(
            "UPDATE instances i "
            "SET blocks_in_use = u.used, free_blocks = i.capacity_blocks - u.used "
            "FROM (SELECT i2.instance, count(b.block_id) FILTER (WHERE b.ref_count > 0) AS used "
            "      FROM instances i2 LEFT JOIN blocks b ON b.instance = i2.instance "
            "      GROUP BY i2.instance) u "
            "WHERE u.instance = i.instance"
        )
    )


def downgrade() -> None:
    op.drop_constraint(op.f("ck_tenants_usage_not_negative"), "tenants", type_="check")
    op.create_check_constraint(
        op.f("ck_tenants_usage_not_negative"),
        "tenants",
        "blocks_in_use >= 0 AND tokens_in_flight >= 0",
    )
    op.drop_constraint(op.f("ck_tenants_state"), "tenants", type_="check")
    op.create_check_constraint(
        op.f("ck_tenants_state"), "tenants", "state IN ('ACTIVE', 'SUSPENDED')"
    )
    op.drop_constraint(op.f("ck_instances_block_states"), "instances", type_="check")
    op.drop_constraint(op.f("ck_instances_hash_algo"), "instances", type_="check")
    op.create_check_constraint(
        op.f("ck_instances_blocks_in_use"),
        "instances",
        "blocks_in_use BETWEEN 0 AND capacity_blocks",
    )
    op.drop_constraint(op.f("fk_tenants_namespace_namespaces"), "tenants", type_="foreignkey")
    op.drop_column("tenants", "offboard_pinned_by_others")
    op.drop_column("tenants", "offboard_shared_blocks")
    op.drop_column("tenants", "offboard_freed_blocks")
    op.drop_column("tenants", "namespace")
    op.drop_column("tenants", "pinned_blocks")
    op.drop_constraint(op.f("uq_reservations_holder_id"), "reservations", type_="unique")
    op.drop_column("reservations", "prefix_hit_blocks")
    op.drop_column("reservations", "holder_id")
    op.drop_column("instances", "pinned_blocks")
    op.drop_column("instances", "cached_blocks")
    op.drop_column("instances", "free_blocks")
    op.drop_column("instances", "hash_algo")
    op.drop_table("tenant_blocks")
    op.drop_index("uq_pins_owner_pin_id", table_name="pins")
    op.drop_table("pins")
    op.drop_index(
        "ix_block_refs_block", table_name="block_refs", postgresql_where=sa.text("NOT released")
    )
    op.drop_table("block_refs")
    op.drop_index(
        "ix_blocks_hash", table_name="blocks", postgresql_where=sa.text("content_hash IS NOT NULL")
    )
    op.drop_index("ix_blocks_free", table_name="blocks", postgresql_where=sa.text("state = 'FREE'"))
    op.drop_index(
        "ix_blocks_cached_lru", table_name="blocks", postgresql_where=sa.text("state = 'CACHED'")
    )
    op.drop_table("blocks")
    op.drop_index("ix_tombstones_freed_at", table_name="tombstones")
    op.drop_table("tombstones")
    op.drop_table("namespaces")
    for sequence in SEQUENCES:
        op.execute(DropSequence(sequence))
