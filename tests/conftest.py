"""A real PostgreSQL for every test that needs one: KVQUOTA_TEST_DATABASE_URL, else the server on
127.0.0.1:5432 when one answers, else an embedded one. Migrations run once into a template
database; each test gets its own uniquely named copy, dropped afterwards, so parallel and repeated
runs never collide."""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Iterator

import psycopg
import pytest
from sqlalchemy import make_url
from sqlalchemy.ext.asyncio import AsyncEngine

from quota_service.config import Settings
from quota_service.store import embedded, migrate
from quota_service.store.database import connect

LOCAL_SERVER = "postgresql://postgres@127.0.0.1:5432/postgres"
# The hot path the suite's servers use: memory, as served by default, or the per-block ledger
# (`make test-ledger`) until that is removed.
IN_MEMORY = os.environ.get("KVQUOTA_HOT_PATH", "memory") == "memory"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # The slow tests first: under pytest-xdist a worker that starts one last keeps the whole run
    # waiting for it. The sort is stable, so the rest keep their order.
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def _reachable(url: str) -> bool:
    try:
        with psycopg.connect(url, connect_timeout=2):
            return True
    except psycopg.OperationalError:
        return False


def _with_database(url: str, database: str) -> str:
    return make_url(url).set(database=database).render_as_string(hide_password=False)


def _admin(url: str, sql: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(sql)


@pytest.fixture(scope="session")
def server_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    configured = os.environ.get("KVQUOTA_TEST_DATABASE_URL")
    if configured:
        return configured
    if _reachable(LOCAL_SERVER):
        return LOCAL_SERVER
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # pytest-xdist's workers share their run's directory and so one embedded server:
        # pgserver starts it under a lock and stops it when the last process using it exits.
        base = base.parent
    return embedded.start(base / "embedded-pg")


@pytest.fixture(scope="session")
def template_database(server_url: str) -> Iterator[str]:
    name = f"kvq_template_{uuid.uuid4().hex[:12]}"
    _admin(server_url, f'CREATE DATABASE "{name}"')
    migrate.upgrade(_with_database(server_url, name))
    yield name
    _admin(server_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _fresh_database(server_url: str, template_database: str) -> Iterator[str]:
    name = f"kvq_test_{uuid.uuid4().hex[:12]}"
    _admin(server_url, f'CREATE DATABASE "{name}" TEMPLATE "{template_database}"')
    yield _with_database(server_url, name)
    _admin(server_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def database_url(server_url: str, template_database: str) -> Iterator[str]:
    yield from _fresh_database(server_url, template_database)


@pytest.fixture(scope="module")
def module_database_url(server_url: str, template_database: str) -> Iterator[str]:
    """One database for every test of a module, for tests that each need little of it and
    check what they do to it themselves (the fuzz test)."""
    yield from _fresh_database(server_url, template_database)


@pytest.fixture
async def engine(database_url: str) -> AsyncIterator[AsyncEngine]:
    db = connect(database_url, pool_size=20)
    yield db
    await db.dispose()


# Session-wide: Settings is frozen, and a test that needs others derives them with replace().
@pytest.fixture(scope="session")
def settings() -> Settings:
    # Authentication has its own tests (tests/integration/test_access.py).
    return Settings(
        grpc_listen="127.0.0.1:0",
        metrics_listen="127.0.0.1:0",
        reaper_interval_seconds=0.2,
        auth_required=False,
        hot_path="memory" if IN_MEMORY else "ledger",
    )
