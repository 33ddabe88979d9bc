"""Usage in the ledger: the hourly rollup that closes hours from the events the ledger's own
statements append (core/metering.py integrates them).

Closing an hour is one transaction under a transaction-level advisory lock, so replicas close
each hour once, in order: it reads the previous hour's end levels and every event not accounted
yet up to the hour's end (an event that committed after its own hour closed counts from this
hour's start), writes the hour's rows and marks exactly the events it read with it (one that
commits meanwhile is left to the next hour). A closed hour is never written again."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from datetime import UTC, datetime, timedelta

from sqlalchemy import RowMapping, text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from quota_service.core.metering import (
    HOUR_US,
    BilledHour,
    Counts,
    HourUsage,
    Levels,
    UsageEvent,
    integrate_hour,
)
from quota_service.store.database import in_transaction

_LOCK = text("SELECT pg_advisory_xact_lock(hashtext('kvquota-usage-rollup'))")
_LAST_CLOSED = text("SELECT max(hour) FROM usage_closed_hours")
_FIRST_OPEN_EVENT = text("SELECT min(at) FROM usage_events WHERE hour IS NULL")
_END_LEVELS = text(
    "SELECT tenant, instance, end_blocks, end_pinned, end_cpu_bytes, end_compressed_bytes "
    "FROM usage_hours WHERE hour = :hour"
)
_OPEN_EVENTS = text("SELECT * FROM usage_events WHERE hour IS NULL AND at < :end ORDER BY at, id")
_BYTES_PER_BLOCK = text("SELECT instance, bytes_per_block FROM instances")
_INSERT_HOUR = text(
    """
    INSERT INTO usage_hours (
        hour, tenant, instance, block_us, pinned_block_us, cpu_byte_us, compressed_byte_us,
        tokens_reserved, output_tokens, admitted, queued, refused, reclaimed, shadow_refused,
        bytes_per_block, end_blocks, end_pinned, end_cpu_bytes, end_compressed_bytes)
    SELECT :hour, u.tenant, u.instance, u.block_us, u.pinned_block_us, u.cpu_byte_us,
           u.compressed_byte_us, u.tokens_reserved, u.output_tokens, u.admitted, u.queued,
           u.refused, u.reclaimed, u.shadow_refused, u.bytes_per_block, u.end_blocks,
           u.end_pinned, u.end_cpu_bytes, u.end_compressed_bytes
    FROM jsonb_to_recordset(CAST(:rows AS jsonb)) AS u(
        tenant text, instance text, block_us jsonb, pinned_block_us bigint,
        cpu_byte_us numeric, compressed_byte_us numeric, tokens_reserved bigint,
        output_tokens bigint, admitted bigint, queued bigint, refused jsonb, reclaimed jsonb,
        shadow_refused jsonb, bytes_per_block bigint, end_blocks jsonb, end_pinned bigint,
        end_cpu_bytes bigint, end_compressed_bytes bigint)
    """
)
_MARK_EVENTS = text("UPDATE usage_events SET hour = :hour WHERE id = ANY (CAST(:ids AS bigint[]))")
# Closed hours in a range, in a stable order (the export's bytes depend on it).
_HOURS = text(
    """
    SELECT * FROM usage_hours
    WHERE hour >= :start AND hour < :end
      AND (CAST(:tenant AS text) IS NULL OR tenant = :tenant)
      AND (CAST(:instance AS text) IS NULL OR instance = :instance)
    ORDER BY hour, tenant, instance
    """
)
# Rows fetched at a time while streaming: memory stays bounded whatever the range.
STREAM_BATCH = 1000

# Events are only an hour's input: once it closed, they may go after a retention period.
_PURGE_EVENTS = text(
    """
    DELETE FROM usage_events WHERE id IN (
        SELECT id FROM usage_events
        WHERE hour IS NOT NULL AND hour < now() - make_interval(secs => :retention)
        LIMIT :batch)
    """
)

_CLOSE = text(
    "INSERT INTO usage_closed_hours (hour, events, late_events) VALUES (:hour, :events, :late)"
)


def _micros(at: datetime) -> int:
    return (at - datetime(1970, 1, 1, tzinfo=UTC)) // timedelta(microseconds=1)


def _at(micros: int) -> datetime:
    return datetime(1970, 1, 1, tzinfo=UTC) + timedelta(microseconds=micros)


def _counts(value: Mapping[str, int]) -> dict[int, int]:
    return {int(k): int(v) for k, v in value.items()}


def _counted(row: RowMapping) -> Counts:
    """The counters of an event or an hour row (the same columns in both)."""
    return Counts(
        row["tokens_reserved"],
        row["output_tokens"],
        row["admitted"],
        row["queued"],
        dict(row["refused"]),
        dict(row["reclaimed"]),
        dict(row["shadow_refused"]),
    )


def _event(row: RowMapping) -> UsageEvent:
    return UsageEvent(
        _micros(row["at"]),
        row["tenant"],
        row["instance"],
        _counts(row["blocks"]),
        row["pinned"],
        row["cpu_bytes"],
        _counted(row),
        row["compressed_bytes"],
    )


def _row(usage: HourUsage, bytes_per_block: int | None) -> dict[str, object]:
    return {
        "tenant": usage.tenant,
        "instance": usage.instance,
        "block_us": {str(k): v for k, v in sorted(usage.block_us.items())},
        "pinned_block_us": usage.pinned_block_us,
        "cpu_byte_us": usage.cpu_byte_us,
        "compressed_byte_us": usage.compressed_byte_us,
        "tokens_reserved": usage.counts.tokens_reserved,
        "output_tokens": usage.counts.output_tokens,
        "admitted": usage.counts.admitted,
        "queued": usage.counts.queued,
        "refused": usage.counts.refused,
        "reclaimed": usage.counts.reclaimed,
        "shadow_refused": usage.counts.shadow_refused,
        "bytes_per_block": bytes_per_block,
        "end_blocks": {str(k): v for k, v in sorted(usage.end.blocks.items())},
        "end_pinned": usage.end.pinned,
        "end_cpu_bytes": usage.end.cpu_bytes,
        "end_compressed_bytes": usage.end.compressed_bytes,
    }


class UsageRollup:
    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine

    async def close_due(self, now: datetime, grace: timedelta) -> int:
        """Close every hour that ended more than `grace` before `now`, oldest first; returns
        how many."""
        closed = 0
        while await in_transaction(self._engine, lambda conn: self._close_next(conn, now, grace)):
            closed += 1
        return closed

    async def purge_events(self, retention_seconds: float, batch: int) -> int:
        """Forget up to `batch` events of hours closed longer ago than the retention."""
        async with self._engine.begin() as conn:
            params = {"retention": retention_seconds, "batch": batch}
            return (await conn.execute(_PURGE_EVENTS, params)).rowcount

    async def _close_next(self, conn: AsyncConnection, now: datetime, grace: timedelta) -> bool:
        await conn.execute(_LOCK)
        last = (await conn.execute(_LAST_CLOSED)).scalar_one_or_none()
        start: dict[tuple[str, str], Levels] = {}
        if last is not None:
            ended = (await conn.execute(_END_LEVELS, {"hour": last})).mappings()
            start = {(r["tenant"], r["instance"]): _end_levels(r) for r in ended}
        first_event = (await conn.execute(_FIRST_OPEN_EVENT)).scalar_one_or_none()
        carried = any(not levels.empty for levels in start.values())
        if last is not None and (carried or first_event is not None):
            hour = last + timedelta(hours=1)
            if not carried and first_event is not None:
                # Nothing held and nothing happened until the next event: skip the empty hours.
                hour = max(hour, _at(_micros(first_event) // HOUR_US * HOUR_US))
        elif first_event is not None:
            hour = _at(_micros(first_event) // HOUR_US * HOUR_US)
        else:
            return False
        end = hour + timedelta(hours=1)
        if end + grace > now:
            return False
        unaccounted = (await conn.execute(_OPEN_EVENTS, {"end": end})).mappings().all()
        events = [_event(r) for r in unaccounted]
        sizes = {i: b for i, b in await conn.execute(_BYTES_PER_BLOCK)}
        usage = integrate_hour(_micros(hour), start, events)
        if usage:
            hours = json.dumps([_row(u, sizes.get(u.instance)) for u in usage])
            await conn.execute(_INSERT_HOUR, {"hour": hour, "rows": hours})
        await conn.execute(_MARK_EVENTS, {"hour": hour, "ids": [r["id"] for r in unaccounted]})
        late = sum(1 for e in events if e.at_us < _micros(hour))
        await conn.execute(_CLOSE, {"hour": hour, "events": len(events), "late": late})
        return True


def billed_hour(row: RowMapping) -> BilledHour:
    usage = HourUsage(
        _micros(row["hour"]),
        row["tenant"],
        row["instance"],
        _counts(row["block_us"]),
        row["pinned_block_us"],
        int(row["cpu_byte_us"]),
        _counted(row),
        _end_levels(row),
        int(row["compressed_byte_us"]),
    )
    return BilledHour(usage, row["bytes_per_block"])


def _end_levels(r: RowMapping) -> Levels:
    """What a closed hour's tenant held on its instance at its end."""
    return Levels(
        _counts(r["end_blocks"]), r["end_pinned"], r["end_cpu_bytes"], r["end_compressed_bytes"]
    )


class UsageBook:
    """Closed hours, for export."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine

    async def hours(
        self, start: datetime, end: datetime, tenant: str | None, instance: str | None
    ) -> AsyncIterator[BilledHour]:
        """The closed hours in [start, end), by hour, tenant and instance, streamed."""
        params = {"start": start, "end": end, "tenant": tenant, "instance": instance}
        async with self._engine.connect() as conn:
            result = await conn.stream(_HOURS.execution_options(yield_per=STREAM_BATCH), params)
            async for row in result.mappings():
                yield billed_hour(row)
