"""A replica that shuts down under a waiting Admit answers SERVER_SHUTTING_DOWN; the client asks
the next replica with the same request id, which finds the request where it waited: admitted
once, never twice."""

from __future__ import annotations

import asyncio
import signal
import subprocess

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from kvquota.client import AsyncKvquotaClient
from kvquota.v1 import admission_pb2
from kvquota.v1 import resources_pb2 as pb
from quota_service.config import Settings
from quota_service.core.errors import KvQuotaError
from quota_service.core.model import EndReason, ReservationState
from quota_service.store.ledger import Ledger
from tests.integration.invariants import assert_invariants
from tests.integration.ledger_fixtures import add_instance, add_tenant, counters, request
from tests.integration.test_replicas import start_replica


async def queued(ledger: Ledger, request_id: str) -> bool:
    try:
        return (await ledger.get("acme", request_id)).state is ReservationState.QUEUED
    except KvQuotaError:
        return False  # not there yet


def stop(process: subprocess.Popen[str]) -> None:
    if process.poll() is None:
        process.terminate()
    process.wait(timeout=30)
    assert process.stdout is not None
    process.stdout.close()


async def test_admit_moves_to_another_replica_when_its_server_shuts_down(
    engine: AsyncEngine, database_url: str
) -> None:
    await add_instance(engine, blocks=64)
    await add_tenant(engine, "acme")
    ledger = Ledger(engine, Settings().admission_limits)
    await ledger.admit(request("holder", 1000, 24))  # all 64 blocks
    first, first_address = start_replica(database_url, shutdown_grace_seconds="2")
    second, second_address = start_replica(database_url)
    try:
        async with AsyncKvquotaClient([first_address, second_address]) as client:
            admit = admission_pb2.AdmitRequest(
                tenant="tenants/acme",
                request_id="r",
                instance="instances/gpu-0",
                prompt_tokens=100,
                max_output_tokens=28,
            )
            admit.wait_timeout.FromSeconds(30)
            waiting = asyncio.ensure_future(client.admission.Admit(admit))
            for _ in range(200):
                if await queued(ledger, "r"):
                    break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError("the Admit never reached the first replica's queue")
            first.send_signal(signal.SIGTERM)
            # Its grace over, the first replica is gone; the Admit waits on in the second.
            await asyncio.to_thread(first.wait, 30)
            assert not waiting.done()
            await ledger.end("acme", "holder", EndReason.RELEASED)
            admitted = await asyncio.wait_for(waiting, 30)
    finally:
        stop(first)
        stop(second)
    assert admitted.reservation.state == pb.RESERVATION_STATE_ADMITTED
    assert admitted.reservation.reserved_blocks == 8
    await assert_invariants(engine)
    books = await counters(engine)
    assert books["instance:gpu-0"]["blocks_in_use"] == 8
    async with engine.connect() as conn:
        rows = await conn.execute(text("SELECT count(*) FROM reservations WHERE request_id = 'r'"))
        assert rows.scalar_one() == 1
