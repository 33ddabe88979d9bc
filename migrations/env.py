"""Alembic environment: migrations run against the URL the caller passes (see
quota_service/store/migrate.py) or KVQUOTA_DATABASE_URL for the plain `alembic` command."""

from __future__ import annotations

import os

from alembic import context
from sqlalchemy import create_engine, pool, text

from quota_service.store.database import sqlalchemy_url
from quota_service.store.schema import Base

# Replicas that start together must not run the same migration twice.
MIGRATION_LOCK_KEY = 0x6B7671756F7461  # "kvquota"


def run_migrations_online() -> None:
    config = context.config
    url = config.attributes.get("url") or os.environ.get("KVQUOTA_DATABASE_URL")
    if not url:
        raise SystemExit("set KVQUOTA_DATABASE_URL to the database to migrate")
    engine = create_engine(sqlalchemy_url(url), poolclass=pool.NullPool)
    with engine.connect() as connection:
        context.configure(connection=connection, target_metadata=Base.metadata)
        with context.begin_transaction():
            connection.execute(
                text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK_KEY}
            )
            context.run_migrations()
    engine.dispose()


run_migrations_online()
