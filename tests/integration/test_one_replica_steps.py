"""Sweep steps over rows every replica shares (the usage event purge) run in one replica at a
time, under a lock that is always released; the work of an instance (lapsed leases, engine
aborts, dispatch) is done by its owner alone, whichever replica holds a step's lock."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from quota_service.api.server import HotPath, make_hot_path
from quota_service.api.waiting import Waiters
from quota_service.config import Settings
from quota_service.core.model import EndReason, ReservationState
from quota_service.enforcement.cpu_tier_mirror import CpuTierMirror
from quota_service.enforcement.termination import Termination
from quota_service.jobs.follower import Followers
from quota_service.jobs.maintenance import Maintenance
from quota_service.jobs.reclaim_executor import ReclaimExecutor
from quota_service.jobs.reclaim_policy import ReclaimPolicy
from quota_service.metrics import LedgerMetrics
from quota_service.store.cpu_tier import CpuTierBooks
from quota_service.store.ownership import exclusive
from quota_service.store.reservations import RecordedReservations
from quota_service.store.usage import UsageRollup
from tests.integration.invariants import assert_invariants
from tests.integration.ledger_fixtures import add_instance, add_tenant, request

INSTANCES = ("gpu-0", "gpu-1")


def maintenance(
    engine: AsyncEngine, database_url: str, settings: Settings, path: HotPath | None = None
) -> Maintenance:
    """A replica's maintenance loop, built as the server builds it."""
    if path is None:
        path = make_hot_path(settings, engine, Waiters(settings.queue_poll_seconds))
    ledger = path.ledger
    termination = Termination(ledger, 1.0, 5.0)
    reclaim = path.reclaim(engine, settings.cpu_watermarks)
    cpu_tier = CpuTierMirror(CpuTierBooks(engine))
    inspection = path.inspection(engine)

    async def on_ledger(up: bool) -> None:
        pass

    return Maintenance(
        ledger,
        path.offboarding(engine, termination),
        termination,
        Followers(database_url, path.reconciler(engine)),
        LedgerMetrics(path.catalog, inspection, reclaim, 60.0),
        ReclaimExecutor(reclaim, termination, cpu_tier),
        ReclaimPolicy(reclaim, None, 0.9, 30.0),
        cpu_tier,
        UsageRollup(engine),
        settings,
        engine,
        on_ledger,
    )


async def test_a_key_is_held_by_one_holder_at_a_time(engine: AsyncEngine) -> None:
    async with (
        exclusive(engine, "kvquota-test:a") as first,
        exclusive(engine, "kvquota-test:a") as second,
        exclusive(engine, "kvquota-test:b") as other_key,
    ):
        assert (first, second, other_key) == (True, False, True)
    async with exclusive(engine, "kvquota-test:a") as again:
        assert again  # released when its holder finished


async def advisory_locks(engine: AsyncEngine) -> int:
    """Advisory locks held on this database, by any session (a closed session's go once its
    backend has exited: a moment after the client closed the connection)."""
    query = text(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' "
        "AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
    )
    for _ in range(50):
        async with engine.connect() as conn:
            held = int((await conn.execute(query)).scalar_one())
        if held == 0:
            break
        await asyncio.sleep(0.05)
    return held


async def test_a_key_is_released_whatever_ends_the_work(engine: AsyncEngine) -> None:
    """An error in the work, or a cancellation while the lock is being given back, still frees
    the key (a pooled connection would otherwise go back to the pool still holding it)."""

    async def failing() -> None:
        async with exclusive(engine, "kvquota-test:a") as held:
            assert held
            raise RuntimeError("the step failed")

    with pytest.raises(RuntimeError):
        await failing()
    assert await advisory_locks(engine) == 0

    unlocking = asyncio.Event()

    async def work() -> None:
        async with exclusive(engine, "kvquota-test:b") as held:
            assert held
            unlocking.set()  # no await before the block ends: next, the unlock's round trip

    task = asyncio.create_task(work())
    await unlocking.wait()  # runs once the task waits for the unlock's answer
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    assert await advisory_locks(engine) == 0


async def test_each_owner_reaps_the_lapsed_leases_of_its_own_instances(
    engine: AsyncEngine, database_url: str, settings: Settings
) -> None:
    """Served from memory, reaping is no shared step: each replica reaps the instances it owns,
    whichever replica holds the ledger's step lock, and no other."""
    for instance in INSTANCES:
        await add_instance(engine, instance)
    await add_tenant(engine, "acme")
    waiters = Waiters(settings.queue_poll_seconds)
    paths = {
        i: make_hot_path(settings, engine, waiters, f"replica-{i}") for i in ("gpu-0", "gpu-1")
    }
    replicas = {i: maintenance(engine, database_url, settings, path) for i, path in paths.items()}
    steps = replicas["gpu-0"].steps()
    assert not any(s.one_replica for s in steps if s.name in {"lease reaper", "engine aborts"})
    for instance, replica in replicas.items():
        # The first call for an instance makes its replica the owner.
        await replica.ledger.admit(request(instance, 100, 100, instance=instance, lease_ttl=1.0))
    await asyncio.sleep(1.2)
    record = RecordedReservations(engine)

    async def states() -> dict[str, tuple[ReservationState, EndReason | None]]:
        found = [await record.get("acme", instance) for instance in replicas]
        return {r.request_id: (r.state, r.end_reason) for r in found}

    reaped = (ReservationState.ENDED, EndReason.LEASE_EXPIRED)
    try:
        async with exclusive(engine, "kvquota-sweep:lease reaper") as other_replica:
            assert other_replica
            await replicas["gpu-0"].sweep()
            assert await states() == {"gpu-0": reaped, "gpu-1": (ReservationState.ADMITTED, None)}
        await replicas["gpu-1"].sweep()
        assert await states() == {"gpu-0": reaped, "gpu-1": reaped}
    finally:
        for instance, replica in replicas.items():
            await replica.followers.stop()
            await paths[instance].owners.close()
    await assert_invariants(engine)
