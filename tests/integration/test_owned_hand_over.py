"""A replica handing its instances over as it stops: the waits that began on it follow their
reservations in the record, and another replica claims the instances when told, not at its next
lease round."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from quota_service.config import Settings
from quota_service.core.admission import AdmitRequest
from quota_service.core.errors import ServedElsewhere
from quota_service.core.model import EndReason, ReservationState
from quota_service.core.queueing import QueuePolicy
from quota_service.owner.owners import OwnedLedger, Owners
from tests.integration.ledger_fixtures import add_instance, add_tenant, request

LIMITS = Settings().admission_limits
BLOCK = 16
# One request fills the instance (16 blocks of 16 tokens: 255 + 1).
PROMPT, OUTPUT = 16 * BLOCK - 1, 1


@pytest.fixture
async def replicas(engine: AsyncEngine) -> AsyncIterator[tuple[Owners, Owners]]:
    await add_instance(engine, blocks=16, block_size=BLOCK)
    await add_tenant(engine, "acme")
    # The stopping replica looks for a new owner for a third of its lease (a third of a
    # second) before it tells a caller to retry. (A lease of 0.3 s lapsed between its claim
    # and its first call on a machine loaded far past its cores.)
    stopping = Owners(engine, LIMITS, QueuePolicy(), "replica-a", lease_seconds=1.0)
    staying = Owners(engine, LIMITS, QueuePolicy(), "replica-b", lease_seconds=30.0)
    yield stopping, staying
    for owners in (stopping, staying):
        await owners.close()


def queued(request_id: str) -> AdmitRequest:
    return replace(request(request_id, PROMPT, OUTPUT), wait_timeout_seconds=30.0)


async def test_waits_begun_here_follow_their_reservations_once_the_instance_moved(
    engine: AsyncEngine, replicas: tuple[Owners, Owners]
) -> None:
    stopping, staying = replicas
    here, new_owner = (OwnedLedger(engine, owners, LIMITS) for owners in replicas)
    await here.admit(request("holder", PROMPT, OUTPUT))
    for request_id in ("first", "second"):
        reservation, _ = await here.admit(queued(request_id))
        assert reservation.state is ReservationState.QUEUED
    await stopping.hand_over()

    # Moving, and no replica claimed it yet: the record answers.
    assert (await here.follow("acme", "first")).state is ReservationState.QUEUED
    # The other replica's first call claims it; the release admits "first" there.
    await new_owner.end("acme", "holder", EndReason.RELEASED, OUTPUT)
    assert [o.instance for o in staying.served()] == ["gpu-0"]
    assert (await here.follow("acme", "first")).state is ReservationState.ADMITTED
    # A wait budget run out on the stopping replica leaves the request to its new owner, which
    # ends it at the same deadline.
    second, _ = await here.stop_waiting("acme", "second", EndReason.QUEUE_TIMEOUT)
    assert second.state is ReservationState.QUEUED
    assert (await new_owner.get("acme", "second")).state is ReservationState.QUEUED


async def test_an_instance_handed_over_is_claimed_by_a_replica_told_of_it(
    engine: AsyncEngine, replicas: tuple[Owners, Owners]
) -> None:
    stopping, staying = replicas
    await OwnedLedger(engine, stopping, LIMITS).admit(request("holder", PROMPT, OUTPUT))
    await stopping.hand_over()
    staying.on_notification("handed", "gpu-0")  # what hand_over's commit announced
    for _ in range(100):
        if staying.served():
            break
        await asyncio.sleep(0.02)
    assert [o.instance for o in staying.served()] == ["gpu-0"]
    # The stopping replica now finds the new owner for the calls it took (the api layer
    # forwards them there).
    with pytest.raises(ServedElsewhere):
        await stopping.owner("gpu-0")
