"""Integration tests run against a real PostgreSQL (see tests/conftest.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest

from kvquota.v1 import admin_pb2_grpc, admission_pb2_grpc
from quota_service.api import server
from quota_service.config import Settings
from tests.conftest import IN_MEMORY

# What the memory hot path (the default; `make test-ledger` runs the per-block ledger) does not
# serve yet, and why: these tests are skipped on it. Each entry goes once its part moves over.
NOT_YET_IN_MEMORY = {
    "test_one_replica_steps.py::test_a_lapsed_lease_is_reaped_by_the_replica_that_holds": (
        "the per-block ledger's shared steps (each owner reaps its own instances in memory)"
    ),
    # Its queued Admits, woken while the draining replica's instances move, are answered
    # INSTANCE_MOVING instead of waiting on at the new owner.
    "test_shutdown.py::test_sigterm_drains": "a queued Admit is not kept waiting while it moves",
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/integration" in str(item.path):
            item.add_marker(pytest.mark.integration)
        if IN_MEMORY:
            for prefix, why in NOT_YET_IN_MEMORY.items():
                if item.nodeid.removeprefix("tests/integration/").startswith(prefix):
                    item.add_marker(pytest.mark.skip(reason=f"memory hot path: {why}"))


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
