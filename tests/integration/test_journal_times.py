"""A reservation's times go to the record as integer microseconds since the epoch
(store/journal.py, `_micros`), and PostgreSQL makes them timestamps: the record holds what it held
when they went as ISO 8601 (`datetime.fromtimestamp(seconds, UTC).isoformat()`), in new rows and
changed ones, and a new owner reads back the times the live one has."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime
from functools import partial

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from quota_service.config import Settings
from quota_service.core.instance_machine import InstanceMachine, ReservationRecord
from quota_service.core.model import EndReason
from quota_service.core.queueing import QueuePolicy
from quota_service.owner.instance_owner import InstanceOwner, take_over
from quota_service.store.catalog import Catalog
from quota_service.store.journal import Journal
from tests.integration.ledger_fixtures import add_instance, add_tenant, request
from tests.unit.test_journal_times import tricky_times

TIMES = ("admitted_at", "lease_expires_at", "queued_at", "wait_deadline", "suspended_at")
REQUESTS = 60


@pytest.fixture
async def journal(engine: AsyncEngine) -> AsyncIterator[Journal]:
    await add_instance(engine, blocks=4096)
    await add_tenant(engine, "acme")
    journal = Journal(engine)
    yield journal
    await journal.close()


async def owner_of(engine: AsyncEngine, journal: Journal, name: str) -> InstanceOwner:
    limits = Settings().admission_limits
    return await take_over(journal, Catalog(engine), "gpu-0", limits, QueuePolicy(), name)


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
    owner = await owner_of(engine, journal, "replica-a")

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
