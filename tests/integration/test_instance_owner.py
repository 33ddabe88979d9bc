"""An instance served from memory by its owner, journaled to PostgreSQL in group commits: answers
wait for their batch's commit, concurrent operations share commits, a failed or fenced commit
answers nothing as done and stops the owner, and a new owner rebuilds exactly what was
acknowledged."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import replace
from datetime import UTC, datetime
from functools import partial
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from quota_service.config import Settings
from quota_service.core.errors import KvQuotaError
from quota_service.core.instance_machine import InstanceMachine, ReservationRecord
from quota_service.core.model import EndReason, ReservationState
from quota_service.core.queueing import QueuePolicy
from quota_service.core.reasons import Reason
from quota_service.owner.instance_owner import InstanceOwner, take_over
from quota_service.store import journal as journal_module
from quota_service.store.catalog import Catalog
from quota_service.store.journal import BatchRows, Journal
from tests.integration.ledger_fixtures import add_instance, add_tenant, request
from tests.times import tricky_times
from tests.unit.machine_fixtures import assert_same_machine, next_generation, recount

LIMITS = Settings().admission_limits


async def owner_of(engine: AsyncEngine, journal: Journal, name: str = "replica-a") -> InstanceOwner:
    return await take_over(journal, Catalog(engine), "gpu-0", LIMITS, QueuePolicy(), name)


@pytest.fixture
async def journal(engine: AsyncEngine) -> AsyncIterator[Journal]:
    await add_instance(engine, blocks=512)
    await add_tenant(engine, "acme")
    journal = Journal(engine)
    yield journal
    await journal.close()


async def admit(owner: InstanceOwner, request_id: str, prompt: int = 100) -> ReservationState:
    wanted = request(request_id, prompt, 20)
    return await owner.apply(lambda m, now: m.admit(wanted, now).state)


async def admit_prompt(
    owner: InstanceOwner, request_id: str, token_ids: tuple[int, ...]
) -> ReservationState:
    wanted = replace(request(request_id, len(token_ids), 20), prompt_token_ids=token_ids)
    return await owner.apply(lambda m, now: m.admit(wanted, now).state)


async def release(owner: InstanceOwner, request_id: str) -> ReservationState:
    return await owner.apply(
        lambda m, now: m.end("acme", request_id, EndReason.RELEASED, now).state
    )


async def rebuilt(engine: AsyncEngine, journal: Journal, live: InstanceMachine) -> None:
    """A new owner, rebuilt from the record, holds what `live` holds."""
    fresh = await owner_of(engine, journal, "replica-b")
    recount(fresh.machine)
    assert_same_machine(live, fresh.machine)


async def test_concurrent_operations_share_commits(engine: AsyncEngine, journal: Journal) -> None:
    owner = await owner_of(engine, journal)

    async def pair(i: int) -> None:
        assert await admit(owner, f"r{i}") is ReservationState.ADMITTED
        assert await release(owner, f"r{i}") is ReservationState.ENDED

    await asyncio.gather(*(pair(i) for i in range(64)))
    assert owner.stats.operations == 128
    assert owner.stats.batches < owner.stats.operations / 4
    async with engine.connect() as conn:
        ended = await conn.execute(text("SELECT count(*) FROM reservations WHERE state = 'ENDED'"))
        assert ended.scalar_one() == 64
    await rebuilt(engine, journal, owner.machine)


class HeldJournal(Journal):
    """A journal whose writes wait until the test lets them through."""

    def __init__(self, engine: AsyncEngine) -> None:
        super().__init__(engine)
        self.gate = asyncio.Event()
        self.writing = asyncio.Event()

    async def write(self, instance: str, epoch: int, rows: BatchRows) -> int:
        self.writing.set()
        await self.gate.wait()
        return await super().write(instance, epoch, rows)


async def test_answers_wait_for_the_commit_of_what_they_saw(engine: AsyncEngine) -> None:
    await add_instance(engine)
    await add_tenant(engine, "acme")
    journal = HeldJournal(engine)
    owner = await owner_of(engine, journal)
    await _answered_after_commit(owner, journal)
    await journal.close()


async def _answered_after_commit(owner: InstanceOwner, journal: HeldJournal) -> None:
    admitting = asyncio.create_task(admit(owner, "r1"))
    await journal.writing.wait()
    # A read and a refusal that saw r1 wait for its batch too.
    reading = asyncio.create_task(owner.apply(lambda m, now: m.get("acme", "r1").state))
    too_big = request("r2", 8000, 8000)
    refusing = asyncio.create_task(owner.apply(lambda m, now: m.admit(too_big, now)))
    await asyncio.sleep(0.05)
    assert not (admitting.done() or reading.done() or refusing.done())
    journal.gate.set()
    assert await admitting is ReservationState.ADMITTED
    assert await reading is ReservationState.ADMITTED
    with pytest.raises(KvQuotaError):
        await refusing
    # With nothing in flight, a read is answered at once.
    assert await owner.apply(lambda m, now: m.get("acme", "r1").state) is ReservationState.ADMITTED


class FailingJournal(Journal):
    async def write(self, instance: str, epoch: int, rows: BatchRows) -> int:
        raise ConnectionError("PostgreSQL went away")


async def test_a_failed_commit_acknowledges_nothing_and_stops_the_owner(
    engine: AsyncEngine, journal: Journal
) -> None:
    owner = await owner_of(engine, journal)
    assert await admit(owner, "kept") is ReservationState.ADMITTED
    failing = await owner_of(engine, FailingJournal(engine), "replica-b")
    outcomes = await asyncio.gather(
        *(admit(failing, f"lost-{i}") for i in range(5)), return_exceptions=True
    )
    for outcome in outcomes:
        assert isinstance(outcome, KvQuotaError) and outcome.reason is Reason.INSTANCE_MOVING
        assert outcome.retry_delay_seconds
    # The first owner was deposed when replica-b claimed the instance: its next write fails.
    with pytest.raises(KvQuotaError) as stopped:
        await admit(owner, "late")
    assert stopped.value.reason is Reason.INSTANCE_MOVING
    with pytest.raises(KvQuotaError):
        await failing.apply(lambda m, now: m.get("acme", "kept"))
    async with engine.connect() as conn:
        rows = await conn.execute(text("SELECT request_id FROM reservations"))
        assert [r for (r,) in rows] == ["kept"]


async def test_a_deposed_owner_commits_nothing(engine: AsyncEngine, journal: Journal) -> None:
    old = await owner_of(engine, journal)
    assert await admit(old, "before") is ReservationState.ADMITTED
    new = await owner_of(engine, journal, "replica-b")
    with pytest.raises(KvQuotaError) as deposed:
        await admit(old, "after")
    assert deposed.value.reason is Reason.INSTANCE_MOVING
    assert old.failure is not None
    # The new owner has what was acknowledged, and never heard of what was not.
    assert await new.apply(lambda m, now: m.get("acme", "before").state) is (
        ReservationState.ADMITTED
    )
    with pytest.raises(KvQuotaError) as missing:
        await new.apply(lambda m, now: m.get("acme", "after"))
    assert missing.value.reason is Reason.RESERVATION_NOT_FOUND
    async with engine.connect() as conn:
        rows = await conn.execute(text("SELECT request_id FROM reservations"))
        assert [r for (r,) in rows] == ["before"]


async def test_a_new_owner_rebuilds_the_pool_and_stales_old_handles(
    engine: AsyncEngine, journal: Journal
) -> None:
    owner = await owner_of(engine, journal)
    for i in range(6):
        await admit(owner, f"r{i}", prompt=200)
    for i in range(0, 6, 2):
        await release(owner, f"r{i}")
    await rebuilt(engine, journal, owner.machine)
    new = await owner_of(engine, journal, "replica-c")
    free = [b for b in range(512) if new.machine.pool.state(b) == "FREE"]
    assert min(new.machine.pool.generation(b) for b in free) > max(
        owner.machine.pool.generation(b) for b in range(512)
    )


@pytest.mark.parametrize("chunk_slots", [journal_module.CHECKPOINT_CHUNK_SLOTS, 7])
async def test_checkpoints_keep_recovery_to_what_is_live(
    engine: AsyncEngine, journal: Journal, chunk_slots: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # With small chunks, a checkpoint is many rows.
    monkeypatch.setattr(journal_module, "CHECKPOINT_CHUNK_SLOTS", chunk_slots)
    recorded = await journal.load("gpu-0", "replica-a", "", 0.0)
    tenants = await journal.tenants()
    found = await Catalog(engine).get_instance("gpu-0")
    machine = InstanceMachine.recover(
        found.spec, LIMITS, tenants, recorded.image, recorded.generation_floor
    )
    owner = InstanceOwner(machine, journal, recorded.epoch, checkpoint_min_slots=50)
    for i in range(40):
        # Prompts with their token ids: their full blocks are hashed, and cached once released.
        await admit_prompt(owner, f"r{i}", tuple(range(i, i + 160)))
        await release(owner, f"r{i}")
    async with engine.connect() as conn:
        chunks = await conn.execute(text("SELECT chunk, batch FROM pool_checkpoints ORDER BY 1"))
        numbers, batches = zip(*chunks, strict=True)
        checkpoint = batches[0]
        deltas = (await conn.execute(text("SELECT batch FROM pool_deltas"))).scalars().all()
    # Only the last checkpoint's chunks, and the deltas after it, are kept.
    assert set(batches) == {checkpoint}
    assert numbers == tuple(range(len(numbers))) and (len(numbers) > 1) == (chunk_slots == 7)
    assert deltas and all(batch > checkpoint for batch in deltas)
    await rebuilt(engine, journal, owner.machine)


class GatedCheckpoints(Journal):
    """A journal whose checkpoints wait until the test lets them through."""

    def __init__(self, engine: AsyncEngine) -> None:
        super().__init__(engine)
        self.gate = asyncio.Event()
        self.checkpointing = asyncio.Event()
        self.written = asyncio.Event()

    async def write_checkpoint(
        self, instance: str, epoch: int, batch: int, chunks: Sequence[Mapping[str, Any]]
    ) -> None:
        self.checkpointing.set()
        await self.gate.wait()
        await super().write_checkpoint(instance, epoch, batch, chunks)
        self.written.set()


async def _checkpointing_owner(engine: AsyncEngine, journal: Journal) -> InstanceOwner:
    """An owner of gpu-0 that checkpoints every 50 slot changes or so."""
    recorded = await journal.load("gpu-0", "replica-a", "", 0.0)
    found = await Catalog(engine).get_instance("gpu-0")
    machine = InstanceMachine.recover(
        found.spec, LIMITS, await journal.tenants(), recorded.image, recorded.generation_floor
    )
    return InstanceOwner(machine, journal, recorded.epoch, checkpoint_min_slots=50)


async def _until_checkpointing(owner: InstanceOwner, journal: GatedCheckpoints) -> int:
    """Admit and release prompts until a checkpoint is being written; returns how many."""
    for i in range(100):
        await admit_prompt(owner, f"r{i}", tuple(range(i, i + 160)))
        await release(owner, f"r{i}")
        if journal.checkpointing.is_set():
            return i + 1
    raise AssertionError("no checkpoint was taken")


async def test_batches_commit_while_a_checkpoint_is_written(engine: AsyncEngine) -> None:
    await add_instance(engine, blocks=512)
    await add_tenant(engine, "acme")
    journal = GatedCheckpoints(engine)
    owner = await _checkpointing_owner(engine, journal)
    done = await _until_checkpointing(owner, journal)
    # The checkpoint is held: the operations after it are answered all the same.
    for i in range(done, done + 5):
        assert await admit_prompt(owner, f"r{i}", tuple(range(i, i + 160))) is (
            ReservationState.ADMITTED
        )
    journal.gate.set()
    await owner.retire("the test is done")  # waits for the checkpoint
    async with engine.connect() as conn:
        checkpoint = (await conn.execute(text("SELECT max(batch) FROM pool_checkpoints"))).scalar()
        deltas = (await conn.execute(text("SELECT batch FROM pool_deltas"))).scalars().all()
        last = (await conn.execute(text("SELECT batch FROM instance_owners"))).scalar_one()
    # It records the batch it was taken with; the deltas of the batches after it stay.
    assert checkpoint is not None and checkpoint < last
    assert deltas and min(deltas) > checkpoint
    await rebuilt(engine, journal, owner.machine)
    await journal.close()


class CheckpointBeforeDeltas:
    """The record's connection, on which the held checkpoint commits just before the deltas
    are read (after the last checkpoint was)."""

    def __init__(self, connection: AsyncConnection, journal: GatedCheckpoints) -> None:
        self.connection = connection
        self.journal = journal

    async def execute(self, statement: Any, parameters: Any = None) -> Any:
        if statement is journal_module._DELTAS:
            self.journal.gate.set()
            await self.journal.written.wait()
        return await self.connection.execute(statement, parameters)


async def test_the_record_read_while_a_checkpoint_commits_is_whole(
    engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    await add_instance(engine, blocks=512)
    await add_tenant(engine, "acme")
    journal = GatedCheckpoints(engine)
    owner = await _checkpointing_owner(engine, journal)
    await _until_checkpointing(owner, journal)
    recorded = journal_module._recorded

    async def read_across_the_checkpoint(
        connection: AsyncConnection, instance: str, found: Mapping[str, Any]
    ) -> journal_module.RecordedInstance:
        return await recorded(CheckpointBeforeDeltas(connection, journal), instance, found)  # type: ignore[arg-type]

    monkeypatch.setattr(journal_module, "_recorded", read_across_the_checkpoint)
    read = await journal.read("gpu-0")
    assert journal.written.is_set()  # the checkpoint committed mid-read, dropping its deltas
    live = owner.machine
    fresh = InstanceMachine.recover(
        live.spec, live.limits, await journal.tenants(), read.image, next_generation(live)
    )
    recount(fresh)
    assert_same_machine(live, fresh)
    await owner.retire("the test is done")
    await journal.close()


async def test_a_deposed_owner_s_checkpoint_writes_nothing(engine: AsyncEngine) -> None:
    await add_instance(engine, blocks=512)
    await add_tenant(engine, "acme")
    journal = GatedCheckpoints(engine)
    owner = await _checkpointing_owner(engine, journal)
    await _until_checkpointing(owner, journal)
    claimed = await owner_of(engine, journal, "replica-b")  # a takeover, while it is held
    journal.gate.set()
    # The owner learns from its checkpoint that it was deposed, and stops.
    for _ in range(100):
        if owner.failure is not None:
            break
        await asyncio.sleep(0.02)
    assert owner.failure == "a newer owner took it"
    async with engine.connect() as conn:
        assert (await conn.execute(text("SELECT count(*) FROM pool_checkpoints"))).scalar() == 0
    await rebuilt(engine, journal, claimed.machine)
    await journal.close()


# A reservation's times go to the record as integer microseconds since the epoch
# (store/journal.py, `_micros`), and PostgreSQL makes them timestamps: the record holds what it
# held when they went as ISO 8601, in new rows and changed ones, and a new owner reads back the
# times the live one has.
TIMES = ("admitted_at", "lease_expires_at", "queued_at", "wait_deadline", "suspended_at")
REQUESTS = 60


async def recorded_times(engine: AsyncEngine) -> dict[str, dict[str, datetime | None]]:
    columns = ", ".join((*TIMES, "ended_at"))
    async with engine.connect() as conn:
        rows = await conn.execute(text(f"SELECT request_id, {columns} FROM reservations"))
        return {row.request_id: dict(row._mapping) for row in rows}


async def as_iso_was_recorded(engine: AsyncEngine, times: list[float]) -> list[datetime]:
    """What PostgreSQL made of the times as the journal sent them before, in ISO 8601."""
    iso = [datetime.fromtimestamp(t, UTC).isoformat() for t in times]
    async with engine.connect() as conn:
        rows = await conn.execute(
            text("SELECT unnest(CAST(:iso AS text[]))::timestamptz"), {"iso": iso}
        )
        return list(rows.scalars())


def expected(record: ReservationRecord, column: str) -> datetime | None:
    seconds = getattr(record, column)
    return None if seconds is None else datetime.fromtimestamp(seconds, UTC)


async def test_times_read_back_as_iso_8601_recorded_them(
    engine: AsyncEngine, journal: Journal
) -> None:
    # Each kind of tricky time (14 a second) for a few seconds, in every column.
    times = iter(tricky_times(len(TIMES) * REQUESTS // 14 + 1, seed=7))
    owner = await owner_of(engine, journal)

    def admit(machine: InstanceMachine, now: float, i: int) -> ReservationRecord:
        record = machine.admit(request(f"r{i}", 32, 16), now)
        # Times of every kind, each where rounding to the microsecond could go either way.
        for column in TIMES:
            setattr(record, column, next(times))
        return record

    live = [await owner.apply(partial(admit, i=i)) for i in range(REQUESTS)]
    sent = {record.params.request_id: record for record in live}
    found = await recorded_times(engine)
    for request_id, record in sent.items():
        for column in TIMES:
            assert found[request_id][column] == expected(record, column), (request_id, column)
            assert found[request_id][column] is not None

    # The same times as the old ISO 8601 rows had them recorded.
    every = [getattr(record, column) for record in live for column in TIMES]
    assert [found[r.params.request_id][c] for r in live for c in TIMES] == (
        await as_iso_was_recorded(engine, every)
    )

    # Recovery reads back the times the live owner holds.
    recorded = await journal.read("gpu-0")
    back = {record.params.request_id: record for record in recorded.image.reservations}
    for request_id, record in sent.items():
        for column in TIMES:
            seconds = getattr(back[request_id], column)
            assert seconds == datetime.fromtimestamp(getattr(record, column), UTC).timestamp()

    # Changed rows (ended, a time of their own) the same way; the ones set to None are NULL.
    ended_at = iter(tricky_times(REQUESTS // 14 + 1, seed=8))

    def end(machine: InstanceMachine, now: float, i: int) -> ReservationRecord:
        record = machine.end("acme", f"r{i}", EndReason.RELEASED, now)
        record.ended_at = next(ended_at)
        record.suspended_at = None
        return record

    ended = [await owner.apply(partial(end, i=i)) for i in range(REQUESTS)]
    found = await recorded_times(engine)
    for record in ended:
        for column in (*TIMES, "ended_at"):
            assert found[record.params.request_id][column] == expected(record, column), column
        assert found[record.params.request_id]["suspended_at"] is None
    assert [found[r.params.request_id]["ended_at"] for r in ended] == (
        await as_iso_was_recorded(engine, [r.ended_at for r in ended if r.ended_at is not None])
    )
