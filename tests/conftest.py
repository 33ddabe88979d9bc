"""A real PostgreSQL for every test that needs one: KVQUOTA_TEST_DATABASE_URL, else the server on
127.0.0.1:5432 when one answers, else an embedded one. Migrations run once into a template
database; each test gets its own uniquely named copy, dropped afterwards, so parallel and repeated
runs never collide."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Generator, Iterator

import psycopg
import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from quota_service.api import server
from quota_service.api.waiting import Waiters
from quota_service.config import Settings
from quota_service.store import embedded, migrate
from quota_service.store.database import connect
from tests import processes
from tests.databases import Databases

LOCAL_SERVER = "postgresql://postgres@127.0.0.1:5432/postgres"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # The slow tests first: under pytest-xdist a worker that starts one last keeps the whole run
    # waiting for it. The sort is stable, so the rest keep their order.
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(autouse=True)
def _no_process_outlives_its_test(request: pytest.FixtureRequest) -> Iterator[None]:
    """Kills what the test started and left running (set up before, so torn down after, the
    test's other fixtures); a test that passed fails for it."""
    mark = processes.started()
    yield
    left = processes.kill_since(mark)
    call = getattr(request.node, "rep_call", None)
    if left and call is not None and call.passed:
        pytest.fail(f"the test left these running (now killed): {left}")


@pytest.fixture(scope="session", autouse=True)
def _no_process_outlives_the_session() -> Iterator[None]:
    yield
    left = processes.kill_since()
    assert not left, f"still running at the end of the session (now killed): {left}"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item,
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    # Each phase's report on the item, for the fixtures above to see how the test went.
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report


def _reachable(url: str) -> bool:
    try:
        with psycopg.connect(url, connect_timeout=2):
            return True
    except psycopg.OperationalError:
        return False


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
def databases(server_url: str) -> Iterator[Databases]:
    """Copies of a template database at the latest migration."""
    made = Databases(server_url, migrate.upgrade)
    yield made
    made.close()


@pytest.fixture
def database_url(databases: Databases) -> Iterator[str]:
    with databases.fresh() as url:
        yield url


@pytest.fixture(scope="module")
def module_database_url(databases: Databases) -> Iterator[str]:
    """One database for every test of a module, for tests that each need little of it and
    check what they do to it themselves (the fuzz test)."""
    with databases.fresh() as url:
        yield url


@pytest.fixture
async def engine(database_url: str) -> AsyncIterator[AsyncEngine]:
    db = connect(database_url, pool_size=20)
    yield db
    await db.dispose()


# Session-wide: Settings is frozen, and a test that needs others derives them with replace().
# The in-process servers' maintenance loop sweeps once a second: each sweep is a dozen queries,
# and at five a second the servers of tests that never wait on it cost the suite 15
# CPU-seconds. A module whose tests wait on it (a lease reaped, a job run) overrides `settings`
# with SWEEP_SECONDS.
SWEEP_SECONDS = 0.2


@pytest.fixture(scope="session")
def settings() -> Settings:
    # Authentication has its own tests (tests/integration/test_access.py).
    return Settings(
        grpc_listen="127.0.0.1:0",
        metrics_listen="127.0.0.1:0",
        reaper_interval_seconds=1.0,
        auth_required=False,
    )


@pytest.fixture
async def owned(engine: AsyncEngine, settings: Settings) -> AsyncIterator[server.HotPath]:
    """The memory hot path in this process, as a server builds it: instances are claimed by
    one replica ("test") on first use, its leases renewed as a server renews them (a third of
    a lease apart), and closed at the end."""
    hot = server.make_hot_path(settings, engine, Waiters(0.05), "test")
    owners = hot.owners

    done = asyncio.Event()
    every = settings.owner_lease_seconds / 3
    renewing = asyncio.create_task(server.keep_leases(owners, every, done))
    yield hot
    done.set()
    await renewing
    await owners.close()
