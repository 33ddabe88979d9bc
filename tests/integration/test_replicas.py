"""Two server processes on one database behave as one: 200 concurrent Admits spread over both
never over-commit the instance or a tenant's quota, checked in the database afterwards."""

from __future__ import annotations

import asyncio
import os
import random
import re
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator

import grpc
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from kvquota.v1 import admission_pb2, admission_pb2_grpc
from quota_service.core.model import TenantQuota
from tests import processes
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


def spawn_replica(database_url: str, **settings: str) -> subprocess.Popen[str]:
    """A `kvquota serve` process on database_url, starting (serving_address waits for it)."""
    env = {
        **os.environ,
        "KVQUOTA_DATABASE_URL": database_url,
        "KVQUOTA_GRPC_LISTEN": "127.0.0.1:0",
        "KVQUOTA_METRICS_LISTEN": "127.0.0.1:0",
        "KVQUOTA_AUTH_REQUIRED": "false",
        **{f"KVQUOTA_{k.upper()}": v for k, v in settings.items()},
    }
    return processes.popen(
        [sys.executable, "-m", "quota_service.cli", "serve"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )


def serving_address(process: subprocess.Popen[str]) -> str:
    """The address a spawned replica serves on, once it does."""
    assert process.stdout is not None
    for line in process.stdout:
        match = ADDRESS.search(line)
        if match:
            return match.group(1)
    raise AssertionError(f"replica exited with {process.wait()} before serving")


def start_replica(database_url: str, **settings: str) -> tuple[subprocess.Popen[str], str]:
    """A `kvquota serve` process on database_url; returns it and the address it serves on."""
    process = spawn_replica(database_url, **settings)
    return process, serving_address(process)


@pytest.fixture
def replicas(database_url: str) -> Iterator[list[str]]:
    # Both start at once; each takes a second or more to import and serve.
    spawned = [spawn_replica(database_url) for _ in range(2)]
    yield [serving_address(process) for process in spawned]
    for process in spawned:
        processes.stop(process)


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


async def test_two_replicas_share_one_queue_and_a_killed_one_loses_nothing(
    engine: AsyncEngine, database_url: str
) -> None:
    """Requests that each need the whole instance wait on both replicas; one replica is killed
    while they wait; its callers retry on the other with the same request id. Every request is
    admitted exactly once."""
    await add_instance(engine, blocks=8)
    await add_tenant(engine, "acme")
    victim, survivor = (
        spawn_replica(database_url, reaper_interval_seconds="0.2", owner_lease_seconds="2")
        for _ in range(2)
    )
    victim_address, survivor_address = serving_address(victim), serving_address(survivor)
    channels = [grpc.aio.insecure_channel(a) for a in (victim_address, survivor_address)]
    stubs = [admission_pb2_grpc.AdmissionServiceStub(c) for c in channels]
    admitted: list[str] = []
    retried: list[str] = []

    async def one(i: int) -> None:
        request = admission_pb2.AdmitRequest(
            tenant="tenants/acme",
            request_id=f"w{i}",
            instance="instances/gpu-0",
            prompt_tokens=8 * 16 - 1,
            max_output_tokens=1,
        )
        request.wait_timeout.FromSeconds(60)
        stub = stubs[i % 2]
        while True:
            try:
                reply = await stub.Admit(request)
                break
            except grpc.aio.AioRpcError as error:
                assert error.code() == grpc.StatusCode.UNAVAILABLE, error
                retried.append(request.request_id)
                stub = stubs[1]  # its replica died: ask the other, same request id
        admitted.append(reply.reservation.request_id)
        await asyncio.sleep(0.05)  # the "generation"
        release = admission_pb2.ReleaseRequest(name=reply.reservation.name)
        while True:
            try:
                await stubs[1].Release(release)
                break
            except grpc.aio.AioRpcError as error:
                # Served from memory, the killed replica's instance moves to the survivor once
                # its lease lapses: UNAVAILABLE until then, retried as a client does.
                assert error.code() == grpc.StatusCode.UNAVAILABLE, error
                await asyncio.sleep(0.2)

    try:
        waiting = [asyncio.ensure_future(one(i)) for i in range(12)]
        await asyncio.sleep(0.5)
        victim.send_signal(signal.SIGKILL)
        processes.stop(victim)
        await asyncio.wait_for(asyncio.gather(*waiting), 60)
    finally:
        for channel in channels:
            await channel.close()
        processes.stop(survivor)
    assert retried, "the killed replica had nobody waiting: the test proved nothing"
    assert sorted(admitted) == sorted(f"w{i}" for i in range(12))
    async with engine.connect() as conn:
        rows = await conn.execute(
            text("SELECT request_id, state, end_reason, admitted_at IS NOT NULL FROM reservations")
        )
        assert sorted(tuple(r) for r in rows) == sorted(
            (f"w{i}", "ENDED", "RELEASED", True) for i in range(12)
        )
    await assert_invariants(engine)
