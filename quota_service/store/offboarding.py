"""Offboarding a tenant (DeleteTenant): end its reservations, drop its pins, free the cached
blocks only its salt could ever match, and report what that did. Every step is its own
transaction and the tenant's state (DELETING) says where it is, so a crashed offboarding resumes
by being called again, and calling it after it finished changes nothing.

A reservation an engine may still be running ends only once that engine confirmed the abort, as
a cancelled one does: its blocks are not free before. When the engine does not answer, the abort
stays pending (the maintenance loop retries it, and gives the blocks back after the hard timeout)
and the tenant stays DELETING until the last one ended."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from sqlalchemy import TextClause, text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from quota_service.core.errors import not_found
from quota_service.core.model import EndReason
from quota_service.core.names import tenant_name
from quota_service.core.reasons import Reason
from quota_service.store import blocks
from quota_service.store.catalog import new_salt
from quota_service.store.database import in_transaction
from quota_service.store.ledger import Ledger, dropping_tables
from quota_service.store.pins import Pins

log = logging.getLogger(__name__)

BATCH = 200
# Admitted reservations ended by one statement. 250 tables of 96 blocks take about half a second
# on a 2-core machine; larger batches were slower per reservation and hold the instance's lock
# (which admissions wait for) longer, smaller ones repeat each statement's fixed cost.
RESERVATION_BATCH = 250

# The report is taken once, when offboarding starts, from what the tenant holds then: a block
# is freed when only this tenant references it and its contents are private or under the
# tenant's own salt; otherwise others keep it (referenced, pinned, or cached for a namespace).
_START = text(
    """
    WITH held AS (
        SELECT b.ref_count = tb.refs
               AND (b.hash_scope IS NULL OR b.hash_scope = :scope) AS exclusive,
               b.pin_count > tb.pin_refs AS pinned_by_others
        FROM tenant_blocks tb JOIN blocks b USING (instance, block_id)
        WHERE tb.tenant = :tenant
    ), cached AS (
        SELECT count(*) AS own FROM blocks WHERE state = 'CACHED' AND hash_scope = :scope
    )
    UPDATE tenants SET
        state = 'DELETING', updated_at = now(),
        offboard_freed_blocks = (SELECT count(*) FILTER (WHERE exclusive) FROM held)
                                + (SELECT own FROM cached),
        offboard_shared_blocks = (SELECT count(*) FILTER (WHERE NOT exclusive) FROM held),
        offboard_pinned_by_others = (SELECT count(*) FILTER (WHERE pinned_by_others) FROM held)
    WHERE tenant = :tenant AND state IN ('ACTIVE', 'SUSPENDED')
    """
)

# The same, with what it holds counted by its instances' owners (served from memory).
START_COUNTED = text(
    """
    UPDATE tenants SET
        state = 'DELETING', updated_at = now(), offboard_freed_blocks = :freed,
        offboard_shared_blocks = :shared, offboard_pinned_by_others = :pinned_by_others
    WHERE tenant = :tenant AND state IN ('ACTIVE', 'SUSPENDED')
    """
)
_STATE = text("SELECT state FROM tenants WHERE tenant = :tenant")

# Of the instances :here (NULL: every one), the replica offboarding serves them.
_HERE = "(CAST(:here AS text[]) IS NULL OR {0} = ANY(CAST(:here AS text[])))"
_QUEUED = text(
    "SELECT request_id FROM reservations WHERE tenant = :tenant AND state = 'QUEUED' "
    f"AND {_HERE.format('instance')} LIMIT :batch"
)

# The instances (and their engines) with the tenant's admitted reservations to end; those with
# an abort pending are the maintenance loop's to end.
_INSTANCES_WITH_ADMITTED = text(
    f"""
    SELECT i.instance, i.engine_url FROM instances i
    WHERE {_HERE.format("i.instance")} AND EXISTS (SELECT 1 FROM reservations r
                  WHERE r.tenant = :tenant AND r.instance = i.instance AND r.state = 'ADMITTED'
                    AND r.abort_requested_at IS NULL)
    """
)

# The next batch to end on one instance, and whether each may be running (a suspended session
# is idle between turns). Read before the locks are taken: the engine is asked to abort them
# while admissions go on, and the ending statement skips any that ended meanwhile.
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

# How long a gateway may take, once admitted, to hand the request to the engine. An abort that
# reaches vLLM before the request does is ignored, and the gateway would then run it on blocks
# the ledger had freed: a batch holding requests admitted more recently waits that long first.
FORWARDING_SECONDS = 1.0

# Ends a batch of the tenant's admitted reservations on one instance at once, as Ledger.end ends
# one (TENANT_DELETED, no output tokens): their tables are dropped together, tail first, and the
# counters move by the batch's sums. The caller holds the instance's row, then the tenant's.
_END_BATCH = dropping_tables(
    """
    UPDATE reservations r
    SET state = 'ENDED', ended_at = now(), end_reason = :reason, prompt_token_ids = NULL
    WHERE r.tenant = :tenant AND r.request_id = ANY (CAST(:request_ids AS text[]))
      AND r.state = 'ADMITTED'
    RETURNING r.*
    """
)

_INSTANCES_WITH_OWN_CACHE = text(
    "SELECT DISTINCT instance FROM blocks WHERE state = 'CACHED' AND hash_scope = :scope"
)


# Drop the contents of cached blocks under the tenant's salt: nobody else could match them.
_FREE_OWN_CACHE = text(
    blocks.drop_contents(
        "SELECT block_id, state, content_hash FROM blocks "
        "WHERE instance = :instance AND state = 'CACHED' AND hash_scope = :scope "
        "ORDER BY block_id LIMIT :batch",
        "OFFBOARDED",
        tenant=":tenant",
    )
)

# Finished: the salt is replaced so the old secret is gone, and the tenant leaves its namespace.
_FINISH = text(
    """
    UPDATE tenants SET state = 'DELETED', namespace = NULL, cache_salt = :salt, updated_at = now()
    WHERE tenant = :tenant AND state = 'DELETING'
      AND NOT EXISTS (SELECT 1 FROM tenant_blocks WHERE tenant = :tenant)
      AND NOT EXISTS (SELECT 1 FROM reservations
                      WHERE tenant = :tenant AND state IN ('QUEUED', 'ADMITTED'))
      -- A reservation whose engine confirmed its abort while this pass freed the cache leaves
      -- blocks cached under the tenant's salt: the next pass frees them, then finishes.
      AND NOT EXISTS (SELECT 1 FROM blocks WHERE state = 'CACHED' AND hash_scope = :scope)
    """
)

# The same, with what its instances' owners hold of it said by them (:nothing_held).
FINISH_COUNTED = text(
    """
    UPDATE tenants SET state = 'DELETED', namespace = NULL, cache_salt = :salt, updated_at = now()
    WHERE tenant = :tenant AND state = 'DELETING' AND :nothing_held
      AND NOT EXISTS (SELECT 1 FROM reservations
                      WHERE tenant = :tenant AND state IN ('QUEUED', 'ADMITTED'))
    """
)
# What the tenant holds on the instances other than :here, from the journal's record (served
# from memory by other replicas): as START_COUNTED counts it, and whether anything is left.
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


class EngineAborts(Protocol):
    """How offboarding stops what an engine runs (enforcement.termination.Termination)."""

    async def abort(self, url: str, request_ids: Sequence[str]) -> bool:
        """True once the engine at `url` answered the abort of these requests."""
        ...


class Offboarding:
    def __init__(
        self,
        engine: AsyncEngine,
        ledger: Ledger,
        pins: Pins,
        aborts: EngineAborts,
        reservation_batch: int = RESERVATION_BATCH,
    ) -> None:
        self._engine = engine
        self._ledger = ledger
        self._pins = pins
        self._aborts = aborts
        self._reservation_batch = reservation_batch

    async def delete_tenant(self, tenant: str) -> OffboardingReport:
        scope = tenant_name(tenant)
        await self._start(tenant, scope)
        here = await self._instances_here()
        await self._end_reservations(tenant, here)
        while owned := await self._pins.active_of_tenant(tenant, BATCH, here):
            for owner, pin_id in owned:
                await self._pins.unpin(owner, pin_id)
        await self._free_own_cache(tenant, scope)
        report = await self._finish(tenant, scope)
        if report.finished:
            log.info("offboarded %s: %s", scope, report)
        else:
            log.info("offboarding %s waits for its engines' aborts: %s", scope, report)
        return report

    async def _start(self, tenant: str, scope: str) -> None:
        """The tenant admits nothing from now on (DELETING), with what its offboarding will
        free counted as it holds it now."""
        await self._mark_deleting(tenant, scope, _START, {})

    async def _mark_deleting(
        self, tenant: str, scope: str, statement: TextClause, counted: dict[str, int]
    ) -> None:
        keys = {"tenant": tenant, "scope": scope, **counted}

        async def start(conn: AsyncConnection) -> None:
            state = (await conn.execute(_STATE, keys)).scalar_one_or_none()
            if state is None:
                raise not_found(Reason.TENANT_NOT_FOUND, scope)
            await conn.execute(statement, keys)

        await in_transaction(self._engine, start)

    async def _finish(self, tenant: str, scope: str) -> OffboardingReport:
        """DELETED (a new salt, no namespace) once nothing of the tenant is left."""
        return await self._mark_deleted(tenant, scope, _FINISH, {})

    async def _mark_deleted(
        self, tenant: str, scope: str, statement: TextClause, left: dict[str, bool]
    ) -> OffboardingReport:
        keys = {"tenant": tenant, "scope": scope, **left}

        async def finish(conn: AsyncConnection) -> OffboardingReport:
            await conn.execute(statement, {**keys, "salt": new_salt()})
            row = (await conn.execute(_REPORT, keys)).one()
            return OffboardingReport(*row)

        return await in_transaction(self._engine, finish)

    async def resume_all(self) -> int:
        """Go on with every offboarding a crash interrupted or an engine's abort held up;
        returns how many finished."""
        async with self._engine.connect() as conn:
            tenants = [r[0] for r in await conn.execute(_DELETING)]
        return sum([(await self.delete_tenant(tenant)).finished for tenant in tenants])

    async def _instances_here(self) -> list[str] | None:
        """The instances this replica offboards on (None: every one); the replicas that serve
        the others do their part (resume_all)."""
        return None

    async def recorded_elsewhere(
        self, tenant: str, scope: str, here: Sequence[str]
    ) -> dict[str, int]:
        """What the tenant holds on the instances not `here`, as the journal records it:
        freed, shared and pinned_by_others as offboarding counts them, and left_over."""
        async with self._engine.connect() as conn:
            keys = {"tenant": tenant, "scope": scope, "here": list(here)}
            return dict((await conn.execute(_RECORDED_ELSEWHERE, keys)).mappings().one())

    async def _end_reservations(self, tenant: str, here: list[str] | None) -> None:
        """End every live reservation of the tenant. Queued ones leave the queue one by one,
        through the ledger (the queue limits keep them few); admitted ones end in batches, one
        transaction per batch and instance. The loop ends once a pass finds none: one the
        dispatcher admitted just before offboarding began is found by the next pass. Those
        left waiting for their engine's abort are not looked at again."""
        keys = {"tenant": tenant, "batch": BATCH, "here": here}
        while True:
            async with self._engine.connect() as conn:
                queued = [r[0] for r in await conn.execute(_QUEUED, keys)]
                instances = (await conn.execute(_INSTANCES_WITH_ADMITTED, keys)).all()
            if not queued and not instances:
                return
            for request_id in queued:
                await self._ledger.end(tenant, request_id, EndReason.TENANT_DELETED)
            for instance, url in instances:
                await self._end_on_instance(instance, url, tenant)

    async def _end_on_instance(self, instance: str, url: str | None, tenant: str) -> None:
        """End the tenant's admitted reservations on the instance, a batch at a time; with an
        engine (at `url`), each batch after it confirmed the abort of those it may be running."""
        keys = {"instance": instance, "tenant": tenant, "batch": self._reservation_batch}
        while True:
            async with self._engine.connect() as conn:
                batch = (await conn.execute(_NEXT_BATCH, keys)).all()
            ending = [r.request_id for r in batch]
            running = [r for r in batch if r.running]
            if url is not None and running:
                youngest = min(r.admitted_seconds_ago for r in running)
                await asyncio.sleep(max(0.0, FORWARDING_SECONDS - youngest))
                aborting = [r.request_id for r in running]
                if not await self._aborts.abort(url, aborting):
                    await self._ledger.request_aborts(tenant, aborting, EndReason.TENANT_DELETED)
                    ending = [r.request_id for r in batch if not r.running]
            if ending:
                await self._end_batch(instance, tenant, ending)
            if len(batch) < self._reservation_batch:
                return

    async def _end_batch(self, instance: str, tenant: str, request_ids: Sequence[str]) -> None:
        params = {
            "instance": instance,
            "tenant": tenant,
            "reason": EndReason.TENANT_DELETED.value,
            "request_ids": list(request_ids),
            "observed": False,
            "offloading": False,
        }

        async def work(conn: AsyncConnection) -> None:
            await conn.execute(blocks.LOCK_INSTANCE, params)
            await conn.execute(blocks.LOCK_TENANT, params)
            await conn.execute(_END_BATCH, params)

        await in_transaction(self._engine, work)

    async def _free_own_cache(self, tenant: str, scope: str) -> None:
        """Drop the contents of every block cached under the tenant's salt, on every instance."""
        async with self._engine.connect() as conn:
            keys = {"scope": scope}
            instances = [r[0] for r in await conn.execute(_INSTANCES_WITH_OWN_CACHE, keys)]
        for instance in instances:
            await self._free_own_cache_on(instance, tenant, scope)

    async def _free_own_cache_on(self, instance: str, tenant: str, scope: str) -> None:
        params = {"instance": instance, "tenant": tenant, "scope": scope, "batch": 10 * BATCH}
        while True:

            async def work(conn: AsyncConnection) -> int:
                await conn.execute(blocks.LOCK_INSTANCE, params)
                return int((await conn.execute(_FREE_OWN_CACHE, params)).one().freed)

            if await in_transaction(self._engine, work) < 10 * BATCH:
                return
