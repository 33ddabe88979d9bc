"""An owner whose lease lapsed on its own clock before a renewal came round (its process starved
or paused for a while): it serves on, from the same memory, when no other replica claimed the
instance meanwhile, and stops, answering nothing, when one did."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from quota_service.config import Settings
from quota_service.core.errors import ServedElsewhere
from quota_service.core.model import EndReason, ReservationState
from quota_service.core.queueing import QueuePolicy
from quota_service.owner.owners import OwnedLedger, Owners
from tests.integration.ledger_fixtures import add_instance, add_tenant, request

LIMITS = Settings().admission_limits
LEASE_SECONDS = 0.3


@pytest.fixture
async def replicas(engine: AsyncEngine) -> AsyncIterator[tuple[Owners, Owners]]:
    await add_instance(engine, blocks=64)
    await add_tenant(engine, "acme")
    # Neither renews its leases here (no lease round runs): the first one's lapse.
    starved = Owners(engine, LIMITS, QueuePolicy(), "replica-a", lease_seconds=LEASE_SECONDS)
    other = Owners(engine, LIMITS, QueuePolicy(), "replica-b", lease_seconds=30.0)
    yield starved, other
    for owners in (starved, other):
        await owners.close()


async def test_a_lapsed_lease_no_one_claimed_is_renewed_and_the_owner_serves_on(
    engine: AsyncEngine, replicas: tuple[Owners, Owners]
) -> None:
    starved, _ = replicas
    ledger = OwnedLedger(engine, starved, LIMITS)
    await ledger.admit(request("held", 100, 20))
    owner = await starved.owner("gpu-0")
    await asyncio.sleep(LEASE_SECONDS * 1.5)

    # The same owner, under the same epoch: not stopped, not rebuilt from the record.
    assert (await ledger.get("acme", "held")).state is ReservationState.ADMITTED
    assert await starved.owner("gpu-0") is owner
    assert owner.failure is None
    assert (await starved.journal.holder("gpu-0")).owner == "replica-a"  # type: ignore[union-attr]


async def test_a_lapsed_owner_whose_instance_another_claimed_stops_and_commits_nothing(
    engine: AsyncEngine, replicas: tuple[Owners, Owners]
) -> None:
    starved, other = replicas
    here, there = OwnedLedger(engine, starved, LIMITS), OwnedLedger(engine, other, LIMITS)
    await here.admit(request("held", 100, 20))
    owner = await starved.owner("gpu-0")
    await asyncio.sleep(LEASE_SECONDS * 1.5)
    await other.owner("gpu-0")  # claims it: its lease lapsed in the record too

    with pytest.raises(ServedElsewhere):
        await here.end("acme", "held", EndReason.RELEASED, 20)
    assert owner.failure is not None
    # The release went nowhere: the new owner still holds the reservation.
    assert (await there.get("acme", "held")).state is ReservationState.ADMITTED
