"""instances.engine_address: Admit finds an instance by its engine's address

Behind an endpoint picker a gateway knows the chosen engine's `ip:port`, not the instance's
name. The registered engine URL is kept reduced to `host:port` (core/engine_address.py), with an
index, so an Admit naming the engine is one indexed lookup. Instances registered before get the
column from their URL here.

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from quota_service.core.engine_address import normalise

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("instances", sa.Column("engine_address", sa.String(length=200), nullable=True))
    op.create_index("ix_instances_engine_address", "instances", ["engine_address"])
    conn = op.get_bind()
    registered = conn.execute(
        sa.text("SELECT instance, engine_url FROM instances WHERE engine_url IS NOT NULL")
    )
    for instance, url in registered.all():
        conn.execute(
            sa.text("UPDATE instances SET engine_address = :address WHERE instance = :instance"),
            {"address": normalise(url), "instance": instance},
        )


def downgrade() -> None:
    op.drop_index("ix_instances_engine_address", table_name="instances")
    op.drop_column("instances", "engine_address")
