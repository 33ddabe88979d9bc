"""Integration tests run against a real PostgreSQL (see tests/conftest.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest

from kvquota.v1 import admin_pb2_grpc, admission_pb2_grpc
from quota_service.api import server
from quota_service.config import Settings


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/integration" in str(item.path):
            item.add_marker(pytest.mark.integration)


@pytest.fixture
async def channel(database_url: str, settings: Settings) -> AsyncIterator[grpc.aio.Channel]:
    running = await server.start(settings, database_url)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as chan:
        yield chan
    await running.stop(0)


@pytest.fixture
def admin(channel: grpc.aio.Channel) -> admin_pb2_grpc.AdminServiceAsyncStub:
    return admin_pb2_grpc.AdminServiceStub(channel)


@pytest.fixture
def gateway(channel: grpc.aio.Channel) -> admission_pb2_grpc.AdmissionServiceAsyncStub:
    return admission_pb2_grpc.AdmissionServiceStub(channel)
