"""Reservations as the record holds them, for what reads them outside their owner's memory (a
reservation that ended before its instance's machine was rebuilt, one whose instance moved to
another replica) and for the engine-abort bookkeeping that Termination keeps on their rows."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from sqlalchemy import RowMapping, text
from sqlalchemy.ext.asyncio import AsyncEngine

from quota_service.core.block_table import BlockHandle
from quota_service.core.errors import not_found
from quota_service.core.model import EndReason, Reservation, ReservationState
from quota_service.core.names import reservation_name
from quota_service.core.reasons import Reason

# A queued reservation's place: those of higher priority, then those of its own that arrived at
# its owner's queue before it.
_GET_RESERVATION = text(
    """
    SELECT r.*,
           CASE WHEN r.state = 'QUEUED' THEN (
               SELECT count(*) FROM reservations q
               WHERE q.instance = r.instance AND q.state = 'QUEUED'
                 AND (q.priority > r.priority
                      OR (q.priority = r.priority AND q.queue_arrival < r.queue_arrival)))
           END AS queue_position
    FROM reservations r WHERE r.tenant = :tenant AND r.request_id = :request_id
    """
)

_LAPSED_ON_ENGINES = text(
    """
    SELECT r.tenant, r.request_id, i.engine_url, r.suspended_at IS NULL AS running
    FROM reservations r
    JOIN instances i ON i.instance = r.instance
    WHERE r.state = 'ADMITTED' AND r.lease_expires_at <= now() AND i.engine_url IS NOT NULL
      AND r.abort_requested_at IS NULL
    ORDER BY r.lease_expires_at LIMIT :batch
    """
)

_PENDING_ABORTS = text(
    """
    SELECT r.tenant, r.request_id, r.abort_reason,
           extract(epoch FROM now() - r.abort_requested_at)::float8 AS pending_seconds,
           i.engine_url
    FROM reservations r
    JOIN instances i ON i.instance = r.instance
    WHERE r.state = 'ADMITTED' AND r.abort_requested_at IS NOT NULL
    ORDER BY r.abort_requested_at LIMIT :batch
    """
)

_REQUEST_ABORT = text(
    """
    UPDATE reservations
    SET abort_requested_at = coalesce(abort_requested_at, now()),
        abort_reason = coalesce(abort_reason, :reason)
    WHERE tenant = :tenant AND request_id = ANY (CAST(:request_ids AS text[]))
      AND state = 'ADMITTED'
    """
)

_ENGINE_URL = text(
    "SELECT i.engine_url FROM reservations r JOIN instances i ON i.instance = r.instance "
    "WHERE r.tenant = :tenant AND r.request_id = :request_id"
)


class LapsedOnEngine(NamedTuple):
    tenant: str
    request_id: str
    engine_url: str
    running: bool  # not suspended: the engine may be generating for it


class PendingAbort(NamedTuple):
    tenant: str
    request_id: str
    reason: EndReason  # what it ends with once the engine confirmed
    pending_seconds: float
    engine_url: str | None


def _live_table(row: RowMapping) -> tuple[BlockHandle, ...]:
    """The entries of its block table not given back early."""
    released = set(row["released_positions"] or ())
    entries = zip(row["block_ids"] or (), row["block_generations"] or (), strict=True)
    return tuple(BlockHandle(b, g) for i, (b, g) in enumerate(entries) if i not in released)


def reservation_from_row(row: RowMapping) -> Reservation:
    return Reservation(
        tenant=row["tenant"],
        request_id=row["request_id"],
        instance=row["instance"],
        prompt_tokens=row["prompt_tokens"],
        max_output_tokens=row["max_output_tokens"],
        n=row["n"],
        priority=row["priority"],
        state=ReservationState(row["state"]),
        reserved_blocks=row["reserved_blocks"],
        reserved_tokens=row["reserved_tokens"],
        prefix_hit_blocks=row["prefix_hit_blocks"],
        lease_ttl_seconds=row["lease_ttl_seconds"],
        lease_expires_at=row["lease_expires_at"],
        admitted_at=row["admitted_at"],
        ended_at=row["ended_at"],
        end_reason=EndReason(row["end_reason"]) if row["end_reason"] else None,
        output_tokens=row["output_tokens"],
        block_table=_live_table(row),
        queued_at=row["queued_at"],
        wait_deadline=row["wait_deadline"],
        queue_position=row["queue_position"],
        suspended_at=row["suspended_at"],
        offloaded_bytes=row["offloaded_bytes"],
        compressed_bytes=row["compressed_bytes"],
        compression_ratio=(
            row["compress_after_bytes"] / row["compress_before_bytes"]
            if row["compressed_bytes"] is not None
            else None
        ),
        prompt_digest=row["prompt_digest"],
        shadow_refusal=row["shadow_refusal"],
    )


class RecordedReservations:
    """Reads of reservation rows, and the engine aborts asked on them."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine

    async def get(self, tenant: str, request_id: str) -> Reservation:
        keys = {"tenant": tenant, "request_id": request_id}
        async with self._engine.connect() as conn:
            row = (await conn.execute(_GET_RESERVATION, keys)).mappings().first()
        if row is None:
            raise not_found(Reason.RESERVATION_NOT_FOUND, reservation_name(tenant, request_id))
        return reservation_from_row(row)

    async def engine_url(self, tenant: str, request_id: str) -> str | None:
        """The engine that runs this reservation's request, if kvquota follows one."""
        async with self._engine.connect() as conn:
            keys = {"tenant": tenant, "request_id": request_id}
            return (await conn.execute(_ENGINE_URL, keys)).scalar_one_or_none()

    async def request_aborts(
        self, tenant: str, request_ids: Sequence[str], reason: EndReason
    ) -> None:
        """Remember that these reservations must end with `reason` once their engine confirms
        the abort (they keep their blocks until then)."""
        async with self._engine.begin() as conn:
            params = {"tenant": tenant, "request_ids": list(request_ids), "reason": reason.value}
            await conn.execute(_REQUEST_ABORT, params)

    async def lapsed_on_engines(self, batch: int) -> list[LapsedOnEngine]:
        """Admitted reservations whose lease ran out on instances with an engine, no abort
        asked yet."""
        async with self._engine.connect() as conn:
            rows = await conn.execute(_LAPSED_ON_ENGINES, {"batch": batch})
            return [LapsedOnEngine(*row) for row in rows]

    async def pending_aborts(self, batch: int) -> list[PendingAbort]:
        """Aborts asked of an engine that it has not confirmed yet, oldest first."""
        async with self._engine.connect() as conn:
            rows = await conn.execute(_PENDING_ABORTS, {"batch": batch})
            return [
                PendingAbort(t, r, EndReason(reason), pending, url)
                for t, r, reason, pending, url in rows
            ]
