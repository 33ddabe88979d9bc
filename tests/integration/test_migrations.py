"""Migrations are the only way the schema changes: they must build exactly what the models say."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import create_engine, pool

from quota_service.store import migrate
from quota_service.store.database import sqlalchemy_url
from quota_service.store.schema import Base


def test_migrations_match_the_models(database_url: str) -> None:
    assert not migrate.pending(database_url)
    engine = create_engine(sqlalchemy_url(database_url), poolclass=pool.NullPool)
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    engine.dispose()
    assert diff == []
