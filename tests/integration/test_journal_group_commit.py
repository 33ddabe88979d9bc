"""A replica's owners share commits: the batches that wait while one commit is in flight go in
the next transaction together, each passing its own fence; a stale instance's batch fails alone
while the others commit, and PostgreSQL dying in the middle of a commit acknowledges nothing of
it. An owner under load holds its next batch open a moment, so that more operations share a
commit."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from quota_service.config import Settings
from quota_service.core.errors import KvQuotaError
from quota_service.core.model import EndReason, ReservationState
from quota_service.core.queueing import QueuePolicy
from quota_service.core.reasons import Reason
from quota_service.owner.instance_owner import InstanceOwner, take_over
from quota_service.store.catalog import Catalog
from quota_service.store.journal import (
    WRITE_AT_ONCE,
    BatchRows,
    GroupCommit,
    Journal,
    Statement,
    _Batch,
)
from tests.integration.ledger_fixtures import UNLIMITED, add_instance, add_tenant, request
from tests.unit.machine_fixtures import assert_same_machine, recount

LIMITS = Settings().admission_limits
INSTANCES = ("gpu-0", "gpu-1", "gpu-2", "gpu-3")


class GatedJournal(Journal):
    """A journal that starts committing only when the test lets it, and tells which instances
    each transaction held."""

    def __init__(self, engine: AsyncEngine, group_commit: GroupCommit = WRITE_AT_ONCE) -> None:
        super().__init__(engine, group_commit)
        self.gate = asyncio.Event()
        self.gate.set()
        self.transactions: list[list[str]] = []
        self._expected = 0
        self.all_waiting = asyncio.Event()

    def hold(self, batches: int) -> None:
        """Commit nothing until `batches` batches wait (and the gate is set again)."""
        self.gate.clear()
        self.transactions.clear()
        self._expected = batches
        self.all_waiting.clear()

    async def write(self, instance: str, epoch: int, rows: BatchRows) -> int:
        self._expected -= 1
        if self._expected <= 0:
            self.all_waiting.set()
        await self.gate.wait()
        return await super().write(instance, epoch, rows)

    async def _commit(self, batches: list[_Batch]) -> list[int]:
        self.transactions.append([batch.instance for batch in batches])
        return await super()._commit(batches)


@pytest.fixture
async def journal(engine: AsyncEngine) -> AsyncIterator[GatedJournal]:
    for name in INSTANCES:
        await add_instance(engine, name, blocks=256)
    await add_tenant(engine, "acme")
    journal = GatedJournal(engine)
    yield journal
    await journal.close()


async def owner_of(
    engine: AsyncEngine, journal: Journal, instance: str, name: str = "replica-a"
) -> InstanceOwner:
    return await take_over(journal, Catalog(engine), instance, LIMITS, QueuePolicy(), name)


async def admit(owner: InstanceOwner, request_id: str) -> ReservationState:
    wanted = request(request_id, 100, 20, instance=owner.instance)
    return await owner.apply(lambda m, now: m.admit(wanted, now).state)


async def recorded(engine: AsyncEngine) -> list[tuple[str, str, str]]:
    async with engine.connect() as conn:
        rows = await conn.execute(
            text("SELECT instance, request_id, state FROM reservations ORDER BY 1, 2")
        )
        return [(instance, request_id, state) for instance, request_id, state in rows]


def assert_moving(outcome: object) -> None:
    assert isinstance(outcome, KvQuotaError), outcome
    assert outcome.reason is Reason.INSTANCE_MOVING


async def test_batches_that_wait_for_a_commit_share_the_next(
    engine: AsyncEngine, journal: GatedJournal
) -> None:
    owners = [await owner_of(engine, journal, name) for name in INSTANCES]
    # Released together: the first batch commits alone, the three that wait for it together.
    journal.hold(len(owners))
    first = [asyncio.create_task(admit(o, f"{o.instance}-first")) for o in owners]
    await journal.all_waiting.wait()
    journal.gate.set()
    assert set(await asyncio.gather(*first)) == {ReservationState.ADMITTED}
    assert journal.transactions == [["gpu-0"], ["gpu-1", "gpu-2", "gpu-3"]]

    async def pair(owner: InstanceOwner, i: int) -> None:
        assert await admit(owner, f"{owner.instance}-r{i}") is ReservationState.ADMITTED
        ended = await owner.apply(
            lambda m, now: m.end("acme", f"{owner.instance}-r{i}", EndReason.RELEASED, now)
        )
        assert ended.state is ReservationState.ENDED

    await asyncio.gather(*(pair(owner, i) for owner in owners for i in range(8)))
    batches = sum(owner.stats.batches for owner in owners)
    # The owners shared commits: fewer transactions than batches.
    assert journal.stats.commits < batches
    # Each owner grouped its operations: fewer batches than operations.
    assert batches < sum(owner.stats.operations for owner in owners)
    for owner in owners:
        fresh = await owner_of(engine, journal, owner.instance, "replica-b")
        recount(fresh.machine)
        assert_same_machine(owner.machine, fresh.machine)


async def test_a_stale_instance_fails_alone(engine: AsyncEngine, journal: GatedJournal) -> None:
    first = await owner_of(engine, journal, "gpu-2")
    stale = await owner_of(engine, journal, "gpu-0")
    kept = await owner_of(engine, journal, "gpu-1")
    # Another replica takes gpu-0 over: the epoch this replica holds for it is stale now.
    elsewhere = Journal(engine)
    newer = await owner_of(engine, elsewhere, "gpu-0", "replica-b")
    journal.hold(3)
    admitting = [asyncio.create_task(admit(o, f"{o.instance}-after")) for o in (first, stale, kept)]
    await journal.all_waiting.wait()
    journal.gate.set()
    alone, lost, admitted = await asyncio.gather(*admitting, return_exceptions=True)
    assert alone is ReservationState.ADMITTED
    assert_moving(lost)
    assert admitted is ReservationState.ADMITTED
    # The stale batch failed the transaction it shared, which committed nothing; each of its
    # batches then went alone, and the stale one failed its fence alone.
    assert journal.transactions == [["gpu-2"], ["gpu-0", "gpu-1"], ["gpu-0"], ["gpu-1"]]
    assert stale.failure is not None and kept.failure is None and first.failure is None
    assert await admit(kept, "gpu-1-later") is ReservationState.ADMITTED
    assert await recorded(engine) == [
        ("gpu-1", "gpu-1-after", "ADMITTED"),
        ("gpu-1", "gpu-1-later", "ADMITTED"),
        ("gpu-2", "gpu-2-after", "ADMITTED"),
    ]
    with pytest.raises(KvQuotaError) as missing:
        await newer.apply(lambda m, now: m.get("acme", "gpu-0-after"))
    assert missing.value.reason is Reason.RESERVATION_NOT_FOUND
    await elsewhere.close()


async def test_postgresql_dying_mid_commit_acknowledges_none_of_it(
    engine: AsyncEngine, journal: GatedJournal
) -> None:
    owners = [await owner_of(engine, journal, name) for name in ("gpu-0", "gpu-1")]
    for owner in owners:
        assert await admit(owner, f"{owner.instance}-kept") is ReservationState.ADMITTED
    journal.hold(2)
    # gpu-0's commit takes a while (a statement of the record's rides along): its connection
    # is cut in the middle, as a PostgreSQL that dies would; gpu-1's commits beside it.
    slow: list[Statement] = [("SELECT pg_sleep(5)", {})]
    lost = request("gpu-0-lost", 100, 20)
    admitting = [
        asyncio.create_task(owners[0].apply(lambda m, now: m.admit(lost, now), lambda _: slow)),
        asyncio.create_task(admit(owners[1], "gpu-1-beside")),
    ]
    await journal.all_waiting.wait()
    journal.gate.set()
    async with engine.connect() as conn:
        # Each look a statement of its own: a transaction would see one snapshot of the activity.
        await conn.execution_options(isolation_level="AUTOCOMMIT")
        for _ in range(200):
            cut = await conn.execute(
                text(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE wait_event = 'PgSleep' AND datname = current_database()"
                )
            )
            if cut.first() is not None:
                break
            await asyncio.sleep(0.02)
    cut_short, beside = await asyncio.gather(*admitting, return_exceptions=True)
    assert_moving(cut_short)
    assert beside is ReservationState.ADMITTED
    assert sorted(journal.transactions) == [["gpu-0"], ["gpu-1"]]
    assert owners[0].failure is not None and owners[1].failure is None
    assert await recorded(engine) == [
        ("gpu-0", "gpu-0-kept", "ADMITTED"),
        ("gpu-1", "gpu-1-beside", "ADMITTED"),
        ("gpu-1", "gpu-1-kept", "ADMITTED"),
    ]
    # The next owner of gpu-0 rebuilds what was acknowledged, and commits again; gpu-1's owner
    # goes on.
    fresh = await owner_of(engine, journal, "gpu-0", "replica-b")
    assert await admit(fresh, "gpu-0-again") is ReservationState.ADMITTED
    assert await admit(owners[1], "gpu-1-again") is ReservationState.ADMITTED


async def test_a_batch_that_takes_a_tenant_past_its_quota_commits_nothing(
    engine: AsyncEngine, journal: GatedJournal
) -> None:
    # 12 blocks across the fleet; each request needs 8. Each owner decides from its own memory
    # (neither has read what the tenant holds on the other's instance): the record refuses the
    # second batch, which moves nothing.
    await add_tenant(engine, "capped", replace(UNLIMITED, max_blocks=12))
    first, second = [await owner_of(engine, journal, name) for name in ("gpu-0", "gpu-1")]

    async def admit_capped(owner: InstanceOwner, request_id: str) -> ReservationState:
        wanted = request(request_id, 100, 20, tenant="capped", instance=owner.instance)
        return await owner.apply(lambda m, now: m.admit(wanted, now).state)

    assert await admit_capped(first, "kept") is ReservationState.ADMITTED
    with pytest.raises(KvQuotaError) as raced:
        await admit_capped(second, "over")
    assert_moving(raced.value)
    assert second.failure is not None and first.failure is None
    async with engine.connect() as conn:
        totals = await conn.execute(
            text(
                "SELECT 'fleet', blocks_in_use FROM tenants WHERE tenant = 'capped' UNION ALL "
                "SELECT instance, blocks_in_use FROM instance_tenant_totals "
                "WHERE tenant = 'capped' ORDER BY 1"
            )
        )
        assert totals.all() == [("fleet", 8), ("gpu-0", 8)]
    assert await recorded(engine) == [("gpu-0", "kept", "ADMITTED")]


@pytest.mark.parametrize("max_blocks", [16, 12], ids=["both-fit", "one-fits"])
async def test_batches_sharing_a_commit_move_a_tenant_by_their_sum(
    engine: AsyncEngine, journal: GatedJournal, max_blocks: int
) -> None:
    # gpu-2's batch commits alone; gpu-0's and gpu-1's wait for it and share the next
    # transaction, each taking 8 of the tenant's blocks. Where the two do not fit, the shared
    # transaction fails, and each batch then commits or fails on its own: the quota holds.
    await add_tenant(engine, "capped", replace(UNLIMITED, max_blocks=max_blocks))
    leading, shared, other = [
        await owner_of(engine, journal, n) for n in ("gpu-2", "gpu-0", "gpu-1")
    ]

    async def admit_capped(owner: InstanceOwner) -> ReservationState:
        wanted = request(owner.instance, 100, 20, tenant="capped", instance=owner.instance)
        return await owner.apply(lambda m, now: m.admit(wanted, now).state)

    journal.hold(3)
    admitting = [asyncio.create_task(admit(leading, "first"))]
    admitting += [asyncio.create_task(admit_capped(o)) for o in (shared, other)]
    await journal.all_waiting.wait()
    journal.gate.set()
    first, *capped = await asyncio.gather(*admitting, return_exceptions=True)
    assert first is ReservationState.ADMITTED
    async with engine.connect() as conn:
        totals = await conn.execute(
            text(
                "SELECT 'fleet', blocks_in_use FROM tenants WHERE tenant = 'capped' UNION ALL "
                "SELECT instance, blocks_in_use FROM instance_tenant_totals "
                "WHERE tenant = 'capped' AND blocks_in_use > 0 ORDER BY 1"
            )
        )
        found = totals.all()
    if max_blocks == 16:
        assert capped == [ReservationState.ADMITTED] * 2
        assert journal.transactions == [["gpu-2"], ["gpu-0", "gpu-1"]]
        assert found == [("fleet", 16), ("gpu-0", 8), ("gpu-1", 8)]
    else:
        assert capped[0] is ReservationState.ADMITTED
        assert_moving(capped[1])
        assert journal.transactions == [["gpu-2"], ["gpu-0", "gpu-1"], ["gpu-0"], ["gpu-1"]]
        assert found == [("fleet", 8), ("gpu-0", 8)]
    for owner in (shared, other):
        if owner.failure is None:
            fresh = await owner_of(engine, journal, owner.instance, "replica-b")
            recount(fresh.machine)
            assert_same_machine(owner.machine, fresh.machine)


# Long beside the steps of these tests, so that what arrives while an owner waits is certain to
# arrive within the wait.
GATHER = GroupCommit(wait_seconds=1.0, busy_operations=3)


async def _busy_batch(owner: InstanceOwner, journal: GatedJournal) -> list[asyncio.Task[object]]:
    """Three admits in one batch (the owner is busy after it), and two more that arrive while
    it is being written; the first three are answered when this returns."""
    journal.hold(1)
    first = [asyncio.create_task(admit(owner, f"a{i}")) for i in range(3)]
    await journal.all_waiting.wait()
    during = [asyncio.create_task(admit(owner, f"b{i}")) for i in range(2)]
    await asyncio.sleep(0)  # they join the next batch
    journal.gate.set()
    assert set(await asyncio.gather(*first)) == {ReservationState.ADMITTED}
    return list(during)


@pytest.fixture
async def gathering(engine: AsyncEngine, journal: GatedJournal) -> AsyncIterator[GatedJournal]:
    """A journal that holds a busy replica's batches open (the instances are `journal`'s)."""
    gathering = GatedJournal(engine, GATHER)
    yield gathering
    await gathering.close()


@pytest.mark.parametrize("gathers", [True, False], ids=["gather", "at-once"])
async def test_an_owner_under_load_holds_its_next_batch_open_for_more_operations(
    engine: AsyncEngine, journal: GatedJournal, gathering: GatedJournal, gathers: bool
) -> None:
    writing = gathering if gathers else journal
    owner = await owner_of(engine, writing, "gpu-0")
    # A lone operation is written at once, whatever the wait (this one would time the test out).
    assert await asyncio.wait_for(admit(owner, "alone"), 30) is ReservationState.ADMITTED
    owner.stats.batches = owner.stats.operations = 0
    during = await _busy_batch(owner, writing)
    # One more arrives just after the busy batch committed: while the owner waits, it joins the
    # two that arrived during the commit, and the three share one transaction.
    late = asyncio.create_task(admit(owner, "late"))
    answers = await asyncio.gather(*during, late)
    assert set(answers) == {ReservationState.ADMITTED}
    transactions = 2 if gathers else 3
    assert len(writing.transactions) == transactions
    assert owner.stats.batches == transactions and owner.stats.operations == 6
    fresh = await owner_of(engine, writing, "gpu-0", "replica-b")
    recount(fresh.machine)
    assert_same_machine(owner.machine, fresh.machine)


async def test_a_busy_replicas_owners_take_their_batches_at_one_moment(
    engine: AsyncEngine, gathering: GatedJournal
) -> None:
    """Busy is the replica's last transaction, not an owner's last batch: an owner that had
    nothing to write waits for the same moment as the busy one, and their batches share one
    transaction (each owner's batches alone were of one or two operations in a fleet, too few
    to make any owner busy, and its transactions small)."""
    busy = await owner_of(engine, gathering, "gpu-0")
    idle = await owner_of(engine, gathering, "gpu-1")
    during = await _busy_batch(busy, gathering)
    late = asyncio.create_task(admit(idle, "late"))
    answers = await asyncio.gather(*during, late)
    assert set(answers) == {ReservationState.ADMITTED}
    assert gathering.transactions == [["gpu-0"], ["gpu-0", "gpu-1"]]
    for owner in (busy, idle):
        fresh = await owner_of(engine, gathering, owner.instance, "replica-b")
        recount(fresh.machine)
        assert_same_machine(owner.machine, fresh.machine)


async def test_after_a_pause_the_next_operation_is_written_at_once(
    engine: AsyncEngine, gathering: GatedJournal
) -> None:
    """A busy transaction long ago says nothing of what is on its way now: an operation after
    a pause longer than the wait is not held open (it would wait for nothing)."""
    owner = await owner_of(engine, gathering, "gpu-0")
    admitted = await asyncio.gather(*(admit(owner, f"a{i}") for i in range(3)))
    assert set(admitted) == {ReservationState.ADMITTED}
    assert gathering.transactions == [["gpu-0"]]  # one of three operations: the replica is busy
    gathering._ended -= GATHER.wait_seconds  # as if it had paused since
    gathering.hold(1)
    late = asyncio.create_task(admit(owner, "late"))
    # Written at once: the write is asked for well before the wait would have ended.
    await asyncio.wait_for(gathering.all_waiting.wait(), GATHER.wait_seconds / 2)
    gathering.gate.set()
    assert await late is ReservationState.ADMITTED
    assert gathering.transactions == [["gpu-0"]]


async def test_an_owner_stopped_while_it_waits_writes_nothing_more(
    engine: AsyncEngine, gathering: GatedJournal
) -> None:
    owner = await owner_of(engine, gathering, "gpu-0")
    during = await _busy_batch(owner, gathering)
    owner.stop("a newer owner took it")
    for outcome in await asyncio.gather(*during, return_exceptions=True):
        assert_moving(outcome)
    assert len(gathering.transactions) == 1
    assert [request_id for _, request_id, _ in await recorded(engine)] == ["a0", "a1", "a2"]
