"""Invariant 7 for reservations: a server killed with SIGKILL in the middle of Admits and Releases
loses nothing. Its transactions either committed whole or not at all, and the leases of the
requests it was serving run out and are ended, with a reason, by another replica."""

from __future__ import annotations

import asyncio
import signal

import grpc
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from kvquota.v1 import admission_pb2, admission_pb2_grpc
from tests import processes
from tests.integration.grpc_helpers import admit
from tests.integration.invariants import assert_invariants
from tests.integration.ledger_fixtures import add_instance, add_tenant, counters
from tests.integration.test_replicas import start_replica

LEASE_SECONDS = 1
# On the memory hot path, how soon the killed replica's instance is taken over by another.
OWNER_LEASE_SECONDS = "2"
# Calls answered before the kill: the load is well under way, whatever the machine's speed.
ANSWERED_BEFORE_KILL = 100


async def test_kill_9_mid_load_loses_nothing(engine: AsyncEngine, database_url: str) -> None:
    await add_instance(engine, blocks=2000)
    await add_tenant(engine, "acme")
    victim, address = start_replica(database_url, owner_lease_seconds=OWNER_LEASE_SECONDS)
    answered = 0
    under_way = asyncio.Event()

    def one_more_answered() -> None:
        nonlocal answered
        answered += 1
        if answered >= ANSWERED_BEFORE_KILL:
            under_way.set()

    async def client(c: int, channel: grpc.aio.Channel) -> None:
        stub = admission_pb2_grpc.AdmissionServiceStub(channel)
        for i in range(1000):
            request = admit(f"c{c}-{i}", 100, 60)
            request.lease_ttl.FromSeconds(LEASE_SECONDS)
            try:
                admitted = await stub.Admit(request)
                one_more_answered()
                if i % 2:
                    await stub.Release(admission_pb2.ReleaseRequest(name=admitted.reservation.name))
                    one_more_answered()
            except grpc.aio.AioRpcError:
                return  # the server died under us

    async with grpc.aio.insecure_channel(address) as channel:
        clients = [asyncio.create_task(client(c, channel)) for c in range(16)]
        await asyncio.wait_for(under_way.wait(), 60)
        victim.send_signal(signal.SIGKILL)
        processes.stop(victim)
        await asyncio.gather(*clients)

    await assert_invariants(engine)
    assert (await counters(engine))["reservations"]["count"] > 0

    survivor, _ = start_replica(
        database_url, reaper_interval_seconds="0.2", owner_lease_seconds=OWNER_LEASE_SECONDS
    )
    try:
        for _ in range(300):
            await asyncio.sleep(0.1)
            async with engine.connect() as conn:
                live = await conn.execute(
                    text("SELECT count(*) FROM reservations WHERE state = 'ADMITTED'")
                )
                if live.scalar_one() == 0:
                    break
        async with engine.connect() as conn:
            rows = await conn.execute(
                text("SELECT coalesce(end_reason, state), count(*) FROM reservations GROUP BY 1")
            )
            ends: dict[str, int] = {reason: count for reason, count in rows.all()}
    finally:
        processes.stop(survivor)
    assert set(ends) == {"RELEASED", "LEASE_EXPIRED"}, ends
    await assert_invariants(engine)
    books = await counters(engine)
    assert books["instance:gpu-0"]["blocks_in_use"] == 0
    assert books["tenant:acme"]["blocks_in_use"] == 0
