"""Applying and checking Alembic migrations from code (server start-up, tests, the CLI)."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine, pool

from quota_service.store.database import sqlalchemy_url

MIGRATIONS = Path(__file__).resolve().parents[2] / "migrations"


def _config(url: str) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    # Passed as an attribute, not an option: configparser would choke on "%" in passwords.
    config.attributes["url"] = url
    return config


def upgrade(url: str, revision: str = "head") -> None:
    command.upgrade(_config(url), revision)


def downgrade(url: str, revision: str) -> None:
    command.downgrade(_config(url), revision)


def revision_module(revision: str) -> ModuleType:
    """A migration's module, as Alembic loads it (for what one migration made: in tests, and
    in a later migration's downgrade)."""
    module: ModuleType = ScriptDirectory.from_config(_config("")).get_revision(revision).module
    return module


def pending(url: str) -> bool:
    """True when the database is not at the newest revision."""
    head = ScriptDirectory.from_config(_config(url)).get_current_head()
    engine = create_engine(sqlalchemy_url(url), poolclass=pool.NullPool)
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision() != head
    finally:
        engine.dispose()
