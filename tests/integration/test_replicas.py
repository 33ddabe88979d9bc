"""Two server processes on one database behave as one: 200 concurrent Admits spread over both
never over-commit the instance or a tenant's quota, checked in the database afterwards."""

from __future__ import annotations

import asyncio
import os
import random
import re
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator

import grpc
import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from kvquota.v1 import admission_pb2, admission_pb2_grpc
from quota_service.core.model import TenantQuota
from tests.integration.grpc_helpers import rich_error
from tests.integration.invariants import assert_invariants
from tests.integration.ledger_fixtures import add_instance, add_tenant, counters

CAPACITY = 300
QUOTA = TenantQuota(
    max_blocks=120,
    max_tokens_in_flight=10**9,
    max_queued_requests=1,
    max_pinned_blocks=1,
    max_cpu_tier_bytes=1,
)
ADDRESS = re.compile(r"serving gRPC on (\S+)")


def start_replica(database_url: str, **settings: str) -> tuple[subprocess.Popen[str], str]:
    """A `kvquota serve` process on database_url; returns it and the address it serves on."""
    env = {
        **os.environ,
        "KVQUOTA_DATABASE_URL": database_url,
        "KVQUOTA_GRPC_LISTEN": "127.0.0.1:0",
        **{f"KVQUOTA_{k.upper()}": v for k, v in settings.items()},
    }
    process = subprocess.Popen(
        [sys.executable, "-m", "quota_service.cli", "serve"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert process.stdout is not None
    for line in process.stdout:
        match = ADDRESS.search(line)
        if match:
            return process, match.group(1)
    raise AssertionError(f"replica exited with {process.wait()} before serving")


@pytest.fixture
def replicas(database_url: str) -> Iterator[list[str]]:
    started = [start_replica(database_url) for _ in range(2)]
    yield [address for _, address in started]
    for process, _ in started:
        process.terminate()
        process.wait(timeout=30)
        assert process.stdout is not None
        process.stdout.close()


async def test_two_replicas_never_over_commit(engine: AsyncEngine, replicas: list[str]) -> None:
    await add_instance(engine, blocks=CAPACITY)
    tenants = ["t0", "t1", "t2", "t3"]
    for tenant in tenants:
        await add_tenant(engine, tenant, QUOTA)
    rng = random.Random(7)
    channels = [grpc.aio.insecure_channel(address) for address in replicas]
    stubs = [admission_pb2_grpc.AdmissionServiceStub(c) for c in channels]
    outcomes: Counter[str] = Counter()

    async def one(i: int) -> None:
        tenant = rng.choice(tenants)
        prompt, output = rng.randint(16, 300), rng.randint(1, 200)
        request = admission_pb2.AdmitRequest(
            tenant=f"tenants/{tenant}",
            request_id=f"req-{i}",
            instance="instances/gpu-0",
            prompt_tokens=prompt,
            max_output_tokens=output,
        )
        try:
            admitted = await stubs[i % 2].Admit(request)
        except grpc.aio.AioRpcError as error:
            outcomes[rich_error(error).reason] += 1
            return
        outcomes["ADMITTED"] += 1
        if rng.random() < 0.5:  # churn: the other replica gives the blocks back
            release = admission_pb2.ReleaseRequest(name=admitted.reservation.name)
            await stubs[(i + 1) % 2].Release(release)
            outcomes["RELEASED"] += 1

    try:
        await asyncio.gather(*(one(i) for i in range(200)))
    finally:
        for channel in channels:
            await channel.close()

    assert sum(outcomes.values()) - outcomes["RELEASED"] == 200
    assert set(outcomes) <= {"ADMITTED", "RELEASED", "INSTANCE_OVERLOADED", "TENANT_QUOTA_EXCEEDED"}
    assert outcomes["INSTANCE_OVERLOADED"] + outcomes["TENANT_QUOTA_EXCEEDED"] > 0
    await assert_invariants(engine)
    books = await counters(engine)
    assert books["reservations"]["count"] == outcomes["ADMITTED"]
    for tenant in tenants:
        assert books[f"tenant:{tenant}"]["blocks_in_use"] <= QUOTA.max_blocks
