"""The memory hot path's owned services beyond the journal's own tests: the engine followed
(KV events change the instance's machine in the owner's batch that records their sequence
number, as the ledger's reconciler does on the per-block tables, tests/integration/
test_reconcile.py), and request ids the record holds from before a machine knew them."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from quota_service.config import Settings
from quota_service.core import instance_machine
from quota_service.core.errors import KvQuotaError
from quota_service.core.hashing import block_hashes, event_hash
from quota_service.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from quota_service.core.model import EndReason, ReservationState
from quota_service.core.queueing import QueuePolicy
from quota_service.core.reasons import Reason
from quota_service.owner.owned_reconcile import OwnedReconciler
from quota_service.owner.owners import OwnedLedger, Owners
from tests.integration.ledger_fixtures import add_instance, add_tenant, request
from tests.integration.test_reconcile import BS, PROMPT, batch
from tests.unit.machine_fixtures import assert_same_machine

LIMITS = Settings().admission_limits


@pytest.fixture
async def owners(engine: AsyncEngine) -> AsyncIterator[Owners]:
    await add_instance(engine, blocks=16)
    await add_tenant(engine, "acme")
    owners = Owners(engine, LIMITS, QueuePolicy(), "replica-a")
    yield owners
    await owners.close()


@asynccontextmanager
async def another_replica(engine: AsyncEngine) -> AsyncIterator[Owners]:
    """A second replica's owners, closed afterwards (they hold write connections)."""
    other = Owners(engine, LIMITS, QueuePolicy(), "replica-b")
    try:
        yield other
    finally:
        await other.close()


async def reservation_rows(engine: AsyncEngine) -> list[Any]:
    async with engine.connect() as conn:
        return list((await conn.execute(text("SELECT * FROM reservations"))).all())


async def instance_row(engine: AsyncEngine) -> tuple[int, int, int]:
    async with engine.connect() as conn:
        row = await conn.execute(
            text(
                "SELECT c.drift_blocks, i.last_event_seq, i.engine_resyncs FROM instances i "
                "JOIN instance_pool_counters c USING (instance)"
            )
        )
        drift, seq, resyncs = row.one()
        return drift, seq, resyncs


async def test_events_confirm_evict_count_drift_and_are_recorded(
    engine: AsyncEngine, owners: Owners
) -> None:
    ledger = OwnedLedger(engine, owners, LIMITS)
    reconciler = OwnedReconciler(engine, ledger, owners)
    _, salt = await ledger.admit(
        replace(request("a", len(PROMPT), 1), prompt_token_ids=tuple(PROMPT))
    )
    hashes = tuple(event_hash(h) for h in block_hashes(PROMPT, BS, salt))
    machine = (await owners.owner("gpu-0")).machine
    pool = machine.pool

    stored = BlockStored(hashes, None, tuple(PROMPT), BS, "GPU")
    assert await reconciler.apply("gpu-0", 0, batch(stored, stored)) == (0, 0)
    assert [pool.engine_copies(b) for b in range(4)] == [2, 2, 2, 2]
    # The engine evicts blocks the ledger still references: drift, nothing freed.
    removed = BlockRemoved(tuple(hashes[2:]), "GPU")
    assert await reconciler.apply("gpu-0", 1, batch(removed, removed)) == (0, 2)
    assert await instance_row(engine) == (2, 1, 0)
    # Released, they are cached; their last copies evicted, they are freed.
    await ledger.end("acme", "a", EndReason.RELEASED, 1)
    assert [pool.state(b) for b in range(4)] == ["CACHED"] * 4
    assert await reconciler.apply("gpu-0", 2, batch(BlockRemoved(tuple(hashes[:1]), "GPU"))) == (
        0,
        0,
    )
    assert await reconciler.apply("gpu-0", 3, batch(BlockRemoved(tuple(hashes[:1]), "GPU"))) == (
        1,
        0,
    )
    # Another medium's events are not about this pool; a clear forgets every copy.
    assert await reconciler.apply("gpu-0", 4, batch(BlockRemoved(hashes, "CPU"))) == (0, 0)
    assert await reconciler.apply("gpu-0", 5, batch(AllBlocksCleared())) == (3, 0)
    assert pool.counts()["CACHED"] == 0
    assert all(pool.engine_copies(b) == 0 for b in range(pool.capacity))
    assert await instance_row(engine) == (2, 5, 0)

    async with another_replica(engine) as other:
        rebuilt = await other.owner("gpu-0")
        assert_same_machine(machine, rebuilt.machine)


async def test_an_engine_restart_ends_what_ran_on_it(engine: AsyncEngine, owners: Owners) -> None:
    ledger = OwnedLedger(engine, owners, LIMITS)
    reconciler = OwnedReconciler(engine, ledger, owners)
    await ledger.admit(replace(request("a", len(PROMPT), 1), prompt_token_ids=tuple(PROMPT)))
    await ledger.admit(request("b", 40, 10))
    await ledger.end("acme", "b", EndReason.RELEASED, 1)
    assert await reconciler.resynchronise("gpu-0", 7, restarted=True) == 1
    a = await ledger.get("acme", "a")
    assert (a.state, a.end_reason) == (ReservationState.ENDED, EndReason.ENGINE_RESTARTED)
    counts = (await owners.owner("gpu-0")).machine.pool.counts()
    assert (counts["IN_USE"], counts["CACHED"]) == (0, 0)
    assert await instance_row(engine) == (0, 7, 1)


async def test_an_old_request_id_is_answered_from_the_record_never_admitted_anew(
    engine: AsyncEngine, owners: Owners
) -> None:
    """A reservation that ended before the serving replica's memory knew it (another owner,
    or long ago) keeps its request id: an Admit repeating it is refused as ended, and its row
    stays as it was."""
    ledger = OwnedLedger(engine, owners, LIMITS)
    await ledger.admit(request("old", 100, 10))
    await ledger.end("acme", "old", EndReason.RELEASED, 1)
    before = await reservation_rows(engine)
    async with another_replica(engine) as later:
        again = OwnedLedger(engine, later, LIMITS)
        # The batch that would have admitted it again finds its id recorded and commits
        # nothing; the caller is told to retry, and the retry is answered from the record.
        with pytest.raises(KvQuotaError) as moving:
            await again.admit(request("old", 100, 10))
        assert moving.value.reason is Reason.INSTANCE_MOVING
        with pytest.raises(KvQuotaError) as ended:
            await again.admit(request("old", 100, 10))
        assert ended.value.reason is Reason.RESERVATION_ENDED
        with pytest.raises(KvQuotaError) as reused:
            await again.admit(request("old", 200, 10))
        assert reused.value.reason is Reason.REQUEST_ID_REUSED
        # The instance serves on: a new id is admitted.
        fresh, _ = await again.admit(request("new", 100, 10))
        assert fresh.state is ReservationState.ADMITTED
    old = [row for row in await reservation_rows(engine) if row.request_id == "old"]
    assert old == [row for row in before if row.request_id == "old"]


async def test_a_reservation_ended_before_a_takeover_is_answered_ended_not_unknown(
    engine: AsyncEngine, owners: Owners
) -> None:
    """An owner commits a Release and dies before answering it; the caller retries on the
    replica that took the instance over, whose machine was rebuilt from the live reservations
    only. The reservation is acknowledged, so it is never unknown: ending it again returns it
    ended, as on the owner that ended it, and the other calls answer as for an ended one."""
    ledger = OwnedLedger(engine, owners, LIMITS)
    await ledger.admit(request("gone", 100, 10))
    await ledger.end("acme", "gone", EndReason.RELEASED, 3)
    before = await reservation_rows(engine)
    async with another_replica(engine) as later:
        again = OwnedLedger(engine, later, LIMITS)
        released = await again.end("acme", "gone", EndReason.RELEASED, 3)
        assert (released.state, released.end_reason, released.output_tokens) == (
            ReservationState.ENDED,
            EndReason.RELEASED,
            3,
        )
        cancelled, _ = await again.stop_waiting("acme", "gone", EndReason.CANCELLED)
        assert cancelled.end_reason is EndReason.RELEASED
        with pytest.raises(KvQuotaError) as renewing:
            await again.renew("acme", "gone", None)
        assert renewing.value.reason is Reason.RESERVATION_ENDED
        with pytest.raises(KvQuotaError) as unknown:
            await again.end("acme", "never", EndReason.RELEASED)
        assert unknown.value.reason is Reason.RESERVATION_NOT_FOUND
    assert await reservation_rows(engine) == before


async def test_a_reservation_the_machine_forgot_is_answered_ended(
    engine: AsyncEngine, owners: Owners, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A machine keeps a bounded number of ended reservations: one it forgot is ended still."""
    monkeypatch.setattr(instance_machine, "ENDED_RETAINED", 1)
    ledger = OwnedLedger(engine, owners, LIMITS)
    for request_id in ("first", "second"):
        await ledger.admit(request(request_id, 100, 10))
        await ledger.end("acme", request_id, EndReason.RELEASED, 1)
    assert ("acme", "first") not in (await owners.owner("gpu-0")).machine.ended
    released = await ledger.end("acme", "first", EndReason.RELEASED, 1)
    assert (released.state, released.end_reason) == (ReservationState.ENDED, EndReason.RELEASED)


async def test_an_admit_repeating_an_id_the_machine_kept_only_the_id_of_is_answered_ended(
    engine: AsyncEngine, owners: Owners, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past the ended reservations a machine keeps whole, it keeps their ids: an Admit that
    repeats one is answered from the record, and its owner serves on (taken as new, the id
    would fail its batch, and the owner with it)."""
    monkeypatch.setattr(instance_machine, "ENDED_RETAINED", 1)
    ledger = OwnedLedger(engine, owners, LIMITS)
    for request_id in ("first", "second"):
        await ledger.admit(request(request_id, 100, 10))
        await ledger.end("acme", request_id, EndReason.RELEASED, 1)
    owner = await owners.owner("gpu-0")
    assert ("acme", "first") not in owner.machine.ended and owner.machine.knows(("acme", "first"))
    with pytest.raises(KvQuotaError) as repeated:
        await ledger.admit(request("first", 100, 10))
    assert repeated.value.reason is Reason.RESERVATION_ENDED
    assert owner.failure is None and await owners.owner("gpu-0") is owner
