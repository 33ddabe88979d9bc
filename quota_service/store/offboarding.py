"""Offboarding's record: the tenant's state (DELETING, then DELETED) with what its offboarding
frees, and the reads that say what of the tenant is left to end. The offboarding itself runs in
the instances' owners (owner/owned_offboarding.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from quota_service.core.errors import not_found
from quota_service.core.names import tenant_name
from quota_service.core.reasons import Reason
from quota_service.store.catalog import new_salt
from quota_service.store.database import in_transaction

# Queued reservations and pins read at once.
BATCH = 200
# Admitted reservations of one instance read at once: their engine is asked to abort them in one
# call, and a crashed offboarding resumes from the batch it was ending.
RESERVATION_BATCH = 250

# Offboarding starts: the tenant admits nothing from now on, and what offboarding will free is
# counted once, from what the tenant holds then (counted by its instances' owners).
_START = text(
    """
    UPDATE tenants SET
        state = 'DELETING', updated_at = now(), offboard_freed_blocks = :freed,
        offboard_shared_blocks = :shared, offboard_pinned_by_others = :pinned_by_others
    WHERE tenant = :tenant AND state IN ('ACTIVE', 'SUSPENDED')
    """
)
_STATE = text("SELECT state FROM tenants WHERE tenant = :tenant")

# Of the instances :here (those the replica offboarding serves).
_QUEUED = text(
    "SELECT request_id FROM reservations WHERE tenant = :tenant AND state = 'QUEUED' "
    "AND instance = ANY(CAST(:here AS text[])) LIMIT :batch"
)

# The instances (and their engines) with the tenant's admitted reservations to end; those with
# an abort pending are the maintenance loop's to end.
_INSTANCES_WITH_ADMITTED = text(
    """
    SELECT i.instance, i.engine_url FROM instances i
    WHERE i.instance = ANY(CAST(:here AS text[])) AND EXISTS (SELECT 1 FROM reservations r
                  WHERE r.tenant = :tenant AND r.instance = i.instance AND r.state = 'ADMITTED'
                    AND r.abort_requested_at IS NULL)
    """
)

# The next batch to end on one instance, and whether each may be running (a suspended session
# is idle between turns). Any that end meanwhile end only once.
_NEXT_BATCH = text(
    """
    SELECT request_id, suspended_at IS NULL AS running,
           extract(epoch FROM now() - admitted_at)::float8 AS admitted_seconds_ago
    FROM reservations
    WHERE tenant = :tenant AND instance = :instance AND state = 'ADMITTED'
      AND abort_requested_at IS NULL
    ORDER BY lease_expires_at LIMIT :batch
    """
)

# Finished once nothing of the tenant is left (its instances' owners say so: :nothing_held): the
# salt is replaced so the old secret is gone, and the tenant leaves its namespace.
_FINISH = text(
    """
    UPDATE tenants SET state = 'DELETED', namespace = NULL, cache_salt = :salt, updated_at = now()
    WHERE tenant = :tenant AND state = 'DELETING' AND :nothing_held
      AND NOT EXISTS (SELECT 1 FROM reservations
                      WHERE tenant = :tenant AND state IN ('QUEUED', 'ADMITTED'))
    """
)
# What the tenant holds on the instances other than :here, from the journal's record (served
# from memory by other replicas): as _START counts it, and whether anything is left.
# Whether the journal records any instance not `here` (only an instance with an owner row has
# a journal).
_JOURNALED_ELSEWHERE = text(
    "SELECT EXISTS (SELECT 1 FROM instance_owners WHERE instance <> ALL(CAST(:here AS text[])))"
)
_RECORDED_ELSEWHERE = text(
    """
    WITH mine AS (
        SELECT instance, block_id, count(*) AS entries, count(*) FILTER (WHERE pinned) AS pins
        FROM journal_slot_references
        WHERE tenant = :tenant AND instance <> ALL(CAST(:here AS text[]))
        GROUP BY instance, block_id
    ), judged AS (
        SELECT s.ref_count = m.entries AND coalesce(s.hash_scope, :scope) = :scope AS exclusive,
               s.pin_count > m.pins AS pinned_by_others
        FROM mine m JOIN journal_slots s USING (instance, block_id)
    ), cached AS (
        SELECT count(*) AS blocks FROM journal_slots
        WHERE hash_scope = :scope AND ref_count = 0 AND instance <> ALL(CAST(:here AS text[]))
    )
    SELECT (SELECT count(*) FILTER (WHERE exclusive) FROM judged)
               + (SELECT blocks FROM cached) AS freed,
           (SELECT count(*) FILTER (WHERE NOT exclusive) FROM judged) AS shared,
           (SELECT count(*) FILTER (WHERE pinned_by_others) FROM judged) AS pinned_by_others,
           (SELECT count(*) FROM judged) + (SELECT blocks FROM cached) AS left_over
    """
)
_REPORT = text(
    """
    SELECT offboard_freed_blocks, offboard_shared_blocks, offboard_pinned_by_others,
           (SELECT count(*) FROM reservations
            WHERE tenant = :tenant AND state = 'ADMITTED') AS awaiting_engine_aborts,
           state = 'DELETED' AS finished
    FROM tenants WHERE tenant = :tenant
    """
)

# Offboardings to go on with; not those waiting for an engine's abort (the sweep that retries it
# ends the reservation, and the next pass finishes).
_DELETING = text(
    """
    SELECT tenant FROM tenants t
    WHERE state = 'DELETING'
      AND NOT EXISTS (SELECT 1 FROM reservations r
                      WHERE r.tenant = t.tenant AND r.state = 'ADMITTED'
                        AND r.abort_requested_at IS NOT NULL)
    ORDER BY tenant
    """
)


@dataclass(frozen=True, slots=True)
class OffboardingReport:
    freed_blocks: int
    shared_blocks: int
    pinned_by_others: int
    # Reservations whose engine has not confirmed their abort yet: the offboarding finishes
    # once they have ended.
    awaiting_engine_aborts: int
    finished: bool  # the tenant is DELETED


@dataclass(frozen=True, slots=True)
class ToEnd:
    """An admitted reservation offboarding ends."""

    request_id: str
    running: bool  # it may be running on its engine (it is no session idle between turns)
    admitted_seconds_ago: float


class OffboardingRecord:
    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine

    async def mark_deleting(
        self, tenant: str, freed: int, shared: int, pinned_by_others: int
    ) -> None:
        """The tenant admits nothing from now on (DELETING), with what its offboarding will free
        as counted now; NOT_FOUND for no tenant. Once DELETING, the count stays as first taken."""
        keys = {
            "tenant": tenant,
            "freed": freed,
            "shared": shared,
            "pinned_by_others": pinned_by_others,
        }

        async def start(conn: AsyncConnection) -> None:
            state = (await conn.execute(_STATE, keys)).scalar_one_or_none()
            if state is None:
                raise not_found(Reason.TENANT_NOT_FOUND, tenant_name(tenant))
            await conn.execute(_START, keys)

        await in_transaction(self._engine, start)

    async def mark_deleted(self, tenant: str, nothing_held: bool) -> OffboardingReport:
        """DELETED (a new salt, no namespace) when nothing of the tenant is held and no
        reservation of it is live; the report either way."""
        keys = {"tenant": tenant, "nothing_held": nothing_held}

        async def finish(conn: AsyncConnection) -> OffboardingReport:
            await conn.execute(_FINISH, {**keys, "salt": new_salt()})
            row = (await conn.execute(_REPORT, keys)).one()
            return OffboardingReport(*row)

        return await in_transaction(self._engine, finish)

    async def deleting(self) -> list[str]:
        """Tenants whose offboarding is to go on: not those waiting for an engine's abort."""
        async with self._engine.connect() as conn:
            return [r[0] for r in await conn.execute(_DELETING)]

    async def live_of_tenant(
        self, tenant: str, here: Sequence[str]
    ) -> tuple[list[str], list[tuple[str, str | None]]]:
        """On the instances `here`: request ids of the tenant's queued reservations (a batch of
        them), and the instances (with their engines' URLs) where it has admitted ones with no
        abort pending."""
        keys = {"tenant": tenant, "batch": BATCH, "here": list(here)}
        async with self._engine.connect() as conn:
            queued = [r[0] for r in await conn.execute(_QUEUED, keys)]
            instances = [(i, url) for i, url in await conn.execute(_INSTANCES_WITH_ADMITTED, keys)]
        return queued, instances

    async def next_batch(self, instance: str, tenant: str, size: int) -> list[ToEnd]:
        """The next `size` admitted reservations of the tenant on the instance with no abort
        pending, those whose lease ends first first."""
        keys = {"instance": instance, "tenant": tenant, "batch": size}
        async with self._engine.connect() as conn:
            return [ToEnd(*row) for row in await conn.execute(_NEXT_BATCH, keys)]

    async def recorded_elsewhere(self, tenant: str, here: Sequence[str]) -> dict[str, int]:
        """What the tenant holds on the instances not `here`, as the journal records it:
        freed, shared and pinned_by_others as offboarding counts them, and left_over. The
        journal's views derive every slot of the instances they read, checkpoints and deltas
        unnested: with none elsewhere (one replica serves them all), they are not read."""
        async with self._engine.connect() as conn:
            elsewhere = await conn.execute(_JOURNALED_ELSEWHERE, {"here": list(here)})
            if not elsewhere.scalar_one():
                return dict.fromkeys(("freed", "shared", "pinned_by_others", "left_over"), 0)
            keys = {"tenant": tenant, "scope": tenant_name(tenant), "here": list(here)}
            return dict((await conn.execute(_RECORDED_ELSEWHERE, keys)).mappings().one())
