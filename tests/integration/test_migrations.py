"""Migrations are the only way the schema changes: they must build exactly what the models say."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import create_engine, pool, text

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


def test_instances_registered_before_0018_are_found_by_engine_address(database_url: str) -> None:
    migrate.downgrade(database_url, "0017")
    engine = create_engine(sqlalchemy_url(database_url), poolclass=pool.NullPool)
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO instances (instance, block_size, capacity_blocks, free_blocks, "
                "max_model_len, engine_url) VALUES ('gpu-0', 16, 1, 1, 64, 'http://10.0.0.5:8000/')"
            )
        )
    migrate.upgrade(database_url)
    with engine.connect() as conn:
        address = conn.execute(text("SELECT engine_address FROM instances")).scalar_one()
    engine.dispose()
    assert address == "10.0.0.5:8000"
