"""Health follows the ledger: NOT_SERVING until the database is migrated, SERVING once it is,
NOT_SERVING again while the database refuses connections, and SERVING when it is back."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import grpc
import psycopg
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from sqlalchemy import make_url

from quota_service.api import server
from quota_service.config import Settings
from quota_service.store import migrate
from tests.databases import Databases
from tests.integration.grpc_helpers import free_port

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture
def empty_database(databases: Databases) -> Iterator[str]:
    """A database with no migrations applied, on the test server; dropped afterwards."""
    name = databases.create(None)
    yield databases.url(name)
    databases.drop(name)


async def status(address: str) -> Any:
    async with grpc.aio.insecure_channel(address) as channel:
        stub: Any = health_pb2_grpc.HealthStub(channel)
        try:
            return (await stub.Check(health_pb2.HealthCheckRequest(), timeout=2)).status
        except grpc.aio.AioRpcError as error:
            return error.code()


async def eventually(address: str, expected: Any, seconds: float = 20) -> None:
    deadline = asyncio.get_running_loop().time() + seconds
    while (found := await status(address)) != expected:
        assert asyncio.get_running_loop().time() < deadline, f"health stayed {found}"
        await asyncio.sleep(0.2)


async def test_health_waits_for_migrations_and_follows_the_database(
    empty_database: str, settings: Settings
) -> None:
    port = free_port()
    address = f"127.0.0.1:{port}"
    starting = asyncio.create_task(
        server.start(replace(settings, grpc_listen=address), empty_database)
    )
    try:
        # Serving health, but not the services, while the database is not migrated.
        await eventually(address, NOT_SERVING)
        await asyncio.sleep(1.5)
        assert not starting.done()
        await asyncio.to_thread(migrate.upgrade, empty_database)
        running = await asyncio.wait_for(starting, 30)
    except BaseException:
        starting.cancel()
        raise
    try:
        await eventually(address, SERVING)
        name = make_url(empty_database).database
        admin_url = make_url(empty_database).set(database="postgres").render_as_string(False)
        with psycopg.connect(admin_url, autocommit=True) as conn:
            conn.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false')
            conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s",
                (name,),
            )
        await eventually(address, NOT_SERVING)
        with psycopg.connect(admin_url, autocommit=True) as conn:
            conn.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true')
        await eventually(address, SERVING)
    finally:
        await running.stop(0)
