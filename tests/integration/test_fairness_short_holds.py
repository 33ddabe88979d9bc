"""Fairness when holds are shorter than an admission's round trip, served from memory: two
tenants with weights 1 and 3, twelve clients each, every client looping Admit (with a wait
budget), a 50 ms hold, Release, on an instance with room for ten such requests. Every tenant
is backlogged all the time, so the weight-3 tenant must get 75% of the admissions (±7.5 points).
The ledger in PostgreSQL gave it 63-65% here: a release and the dispatch it makes room for were
separate transactions, and clients came back while requests already queued waited."""

from __future__ import annotations

import asyncio
import itertools
import random
from collections import Counter

import grpc
import pytest
from google.protobuf.duration_pb2 import Duration

from kvquota.v1 import admin_pb2, admin_pb2_grpc, admission_pb2, admission_pb2_grpc
from kvquota.v1 import resources_pb2 as pb
from tests import processes
from tests.integration.test_replicas import start_replica

CLIENTS_PER_TENANT = 12
HOLD_SECONDS = 0.05
SECONDS = 6.0
PROMPT, OUTPUT = 1280, 256  # 96 blocks of 16


@pytest.mark.slow
# The share depends on round trips staying short beside the hold: a client whose Release and
# next Admit are still on their way is not waiting in the queue, and a tenant with none waiting
# loses its turn. Among make test's workers on two slow cores the weight-3 tenant got 66.0% and
# 66.7% (twice in six runs); alone, 75.0%, and beside three busy loops or the smoke bench,
# 73-74%. So it runs alone (make test-timing), not among make test's.
@pytest.mark.timing
async def test_weights_hold_when_holds_are_short(database_url: str) -> None:
    # The server in a process of its own, as a gateway meets it: the clients' own work does not
    # slow its event loop.
    process, address = start_replica(database_url)
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            admitted = await flood([channel])
    finally:
        processes.stop(process)
    share = admitted["heavy"] / (admitted["heavy"] + admitted["light"])
    print(f"admissions {dict(admitted)}: the weight-3 tenant got {share:.1%}")
    assert sum(admitted.values()) >= 150, admitted
    assert 0.675 <= share <= 0.825, admitted


async def flood(
    channels: list[grpc.aio.Channel], clients_per_tenant: int = CLIENTS_PER_TENANT
) -> Counter[str]:
    """Admissions of each tenant that waited in the queue; each call goes to one of `channels`
    at random (replicas of one fleet)."""
    admin = admin_pb2_grpc.AdminServiceStub(channels[0])
    gateways = [admission_pb2_grpc.AdmissionServiceStub(c) for c in channels]
    pick = random.Random(5).choice
    await admin.RegisterInstance(
        admin_pb2.RegisterInstanceRequest(
            instance_id="small", block_size=16, max_model_len=8192, num_gpu_blocks=96 * 10
        )
    )
    quota = pb.TenantQuota(
        max_blocks=10**6,
        max_tokens_in_flight=10**9,
        max_queued_requests=1000,
        max_pinned_blocks=1,
        max_cpu_tier_bytes=1,
    )
    for tenant, weight in (("light", 1), ("heavy", 3)):
        await admin.CreateTenant(
            admin_pb2.CreateTenantRequest(
                tenant_id=tenant, tenant=pb.Tenant(quota=quota, weight=weight)
            )
        )
    admitted: Counter[str] = Counter()
    ids = itertools.count()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + SECONDS

    async def client(tenant: str) -> None:
        while loop.time() < deadline:
            request = admission_pb2.AdmitRequest(
                tenant=f"tenants/{tenant}",
                request_id=f"r{next(ids)}",
                instance="instances/small",
                prompt_tokens=PROMPT,
                max_output_tokens=OUTPUT,
                wait_timeout=Duration(seconds=30),
            )
            answer = await pick(gateways).Admit(request)
            # Counted while every tenant is backlogged: those that waited in the queue (the
            # first ones, admitted while the instance filled, are first come, first served),
            # before the flood ends (then clients stop coming back, and the queue drains: the
            # last waiting requests of both tenants are admitted whatever their weights).
            if answer.reservation.HasField("queue_time") and loop.time() < deadline:
                admitted[tenant] += 1
            await asyncio.sleep(HOLD_SECONDS)
            release = admission_pb2.ReleaseRequest(name=answer.reservation.name)
            await pick(gateways).Release(release)

    tenants = ["light", "heavy"] * clients_per_tenant
    await asyncio.gather(*(client(tenant) for tenant in tenants))
    return admitted
