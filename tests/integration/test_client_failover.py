"""A replica that shuts down under a waiting Admit answers SERVER_SHUTTING_DOWN; the client asks
the next replica with the same request id, which finds the request where it waited: admitted
once, never twice."""

from __future__ import annotations

import asyncio
import signal

import grpc
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from kvquota.client import AsyncKvquotaClient, RetryPolicy
from kvquota.v1 import admission_pb2, admission_pb2_grpc
from kvquota.v1 import resources_pb2 as pb
from tests import processes
from tests.integration.grpc_helpers import admit, until_queued
from tests.integration.invariants import assert_invariants
from tests.integration.ledger_fixtures import add_instance, add_tenant, counters
from tests.integration.test_replicas import serving_address, spawn_replica

# On the memory hot path, how soon a stopped replica's instances may be served by another.
OWNER_LEASE_SECONDS = "2"
# On the memory hot path the second replica answers INSTANCE_MOVING (with a retry delay) until
# the first one, its grace over, gave the instance up: a budget for a slow, busy machine.
RETRY = RetryPolicy(max_attempts=10, deadline_seconds=30)


async def test_admit_moves_to_another_replica_when_its_server_shuts_down(
    engine: AsyncEngine, database_url: str
) -> None:
    await add_instance(engine, blocks=64)
    await add_tenant(engine, "acme")
    # Both start at once; each takes a second or more to import and serve.
    first = spawn_replica(
        database_url, shutdown_grace_seconds="2", owner_lease_seconds=OWNER_LEASE_SECONDS
    )
    second = spawn_replica(database_url, owner_lease_seconds=OWNER_LEASE_SECONDS)
    first_address, second_address = serving_address(first), serving_address(second)
    try:
        async with (
            grpc.aio.insecure_channel(first_address) as to_first,
            AsyncKvquotaClient([first_address, second_address], retry=RETRY) as client,
            AsyncKvquotaClient([second_address], retry=RETRY) as to_second_retrying,
        ):
            holder = await admission_pb2_grpc.AdmissionServiceStub(to_first).Admit(
                admit("holder", 1000, 24)  # all 64 blocks
            )
            request = admit("r", 100, 28)
            request.wait_timeout.FromSeconds(30)
            waiting = asyncio.ensure_future(client.admission.Admit(request))
            await until_queued(
                admission_pb2_grpc.AdmissionServiceStub(to_first), "tenants/acme/reservations/r"
            )
            first.send_signal(signal.SIGTERM)
            # Its grace over, the first replica is gone; the Admit waits on in the second.
            await asyncio.to_thread(first.wait, 30)
            assert not waiting.done()
            # The second replica may have forwarded the Admit's retry to the first during its
            # grace; its first call after the first is gone then answers INSTANCE_MOVING with a
            # retry delay (it forgets the lost holder), which a gateway's client retries.
            await to_second_retrying.admission.Release(
                admission_pb2.ReleaseRequest(name=holder.reservation.name)
            )
            admitted = await asyncio.wait_for(waiting, 30)
    finally:
        processes.stop(first)
        processes.stop(second)
    assert admitted.reservation.state == pb.RESERVATION_STATE_ADMITTED
    assert admitted.reservation.reserved_blocks == 8
    await assert_invariants(engine)
    books = await counters(engine)
    assert books["instance:gpu-0"]["blocks_in_use"] == 8
    async with engine.connect() as conn:
        rows = await conn.execute(text("SELECT count(*) FROM reservations WHERE request_id = 'r'"))
        assert rows.scalar_one() == 1
