"""Reclaim jobs' record: jobs and their steps, what a plan reads besides the pool's slots (the
CPU tier and its sessions, each tenant's room there), the reclaim policy's inputs, and the
steps that need only their reservation's row (COMPRESS, EVICT), applied in the transaction that
marks them done. Plans, and FREE and OFFLOAD steps, are the instance's owner's
(owner/owned_reclaim.py): the pool is in its memory."""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import RowMapping, TextClause, text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from quota_service.core.errors import KvQuotaError, not_found
from quota_service.core.model import EndReason, ReservationState
from quota_service.core.names import reclaim_job_name
from quota_service.core.pagination import Page
from quota_service.core.reasons import Reason
from quota_service.core.reclaim import (
    DEFAULT_WATERMARKS,
    CachedScope,
    CompressMeasurement,
    CpuWatermarks,
    Demotion,
    Exclusion,
    InstanceLoad,
    JobState,
    JobStep,
    LiveReservation,
    OffloadedSession,
    PlannedStep,
    PoolSnapshot,
    Preemption,
    ReclaimJob,
    ReclaimPlan,
    ReclaimTally,
    ReclaimTarget,
    StepState,
    Tier,
    Unreclaimable,
    cpu_tier,
)
from quota_service.store.catalog import Catalog
from quota_service.store.cpu_tier import COMPRESSIBLE
from quota_service.store.database import driver_statement, in_transaction

_OFFLOADED = text(
    f"""
    SELECT r.tenant, r.request_id,
           row_number() OVER (ORDER BY r.admitted_at, r.holder_id) AS admitted_seq,
           r.offloaded_bytes
    FROM reservations r WHERE r.instance = :instance AND {COMPRESSIBLE}
    ORDER BY r.admitted_at, r.holder_id
    """
)

# The CPU-tier bytes tenant t may still offload, over every instance: its quota less what its
# offloaded sessions hold, compressed or not (one waiting to resume holds its bytes there until
# admitted).
_CPU_ROOM_OF_T = """
    t.max_cpu_tier_bytes - coalesce((
        SELECT sum(r.offloaded_bytes + coalesce(r.compressed_bytes, 0)) FROM reservations r
        WHERE r.tenant = t.tenant AND r.state IN ('ADMITTED', 'QUEUED')
          AND r.offloaded_bytes IS NOT NULL), 0)::bigint"""

_CPU_ROOM = text(
    f"""
    SELECT t.tenant, {_CPU_ROOM_OF_T} AS room
    FROM tenants t
    WHERE t.tenant IN (SELECT tenant FROM reservations
                       WHERE instance = :instance AND state = 'ADMITTED')
    """
)

_CPU_ROOM_OF_TENANT = text(f"SELECT {_CPU_ROOM_OF_T} FROM tenants t WHERE t.tenant = :tenant")


@dataclass(frozen=True, slots=True)
class PoolBlocks:
    """What the planner needs of an instance's slots: cached blocks by scope, the admitted
    reservations' tables, blocks only pins hold by scope."""

    cached: tuple[CachedScope, ...]
    reservations: tuple[LiveReservation, ...]
    pinned_only: tuple[tuple[str, int], ...]


async def load_snapshot(
    engine: AsyncEngine,
    instance: str,
    blocks: PoolBlocks,
    watermarks: CpuWatermarks = DEFAULT_WATERMARKS,
) -> PoolSnapshot:
    """The instance's pool as the planner sees it: its slots (`blocks`, from its owner's
    memory), with its CPU tier as last read and its sessions there (one repeatable-read
    transaction, so that sessions and tenants' room agree)."""
    # Geometry never changes and the CPU tier is read apart anyway (NOT_FOUND for no instance).
    found = await Catalog(engine).get_instance(instance)
    bytes_per_block = found.spec.bytes_per_block or 0
    age = None
    if found.cpu_checked_at is not None:
        age = (datetime.now(UTC) - found.cpu_checked_at).total_seconds()
    cpu = cpu_tier(
        found.cpu_used_bytes,
        found.cpu_capacity_bytes,
        age,
        watermarks,
        found.cpu_compression_ratio,
    )
    args = {"instance": instance}
    async with engine.connect() as conn:
        await conn.execution_options(isolation_level="REPEATABLE READ")
        cpu_room = {tenant: room for tenant, room in await conn.execute(_CPU_ROOM, args)}
        offloaded = tuple(OffloadedSession(*row) for row in await conn.execute(_OFFLOADED, args))
        await conn.rollback()
    return PoolSnapshot(
        bytes_per_block,
        blocks.cached,
        blocks.reservations,
        blocks.pinned_only,
        cpu,
        offloaded,
        cpu_room,
    )


_INSERT_JOB = text(
    """
    INSERT INTO reclaim_jobs (job_id, request_id, instance, tenant, target_blocks, max_tier,
                              min_tier, dry_run, state, expected_blocks, excluded, finished_at)
    VALUES (:job_id, :request_id, :instance, :tenant, :target_blocks, :max_tier, :min_tier,
            :dry_run, :state, :expected_blocks, CAST(:excluded AS jsonb),
            CASE WHEN :dry_run THEN now() END)
    ON CONFLICT (request_id) DO NOTHING
    RETURNING job_id
    """
)

_INSERT_STEPS = text(
    """
    INSERT INTO reclaim_steps (job_id, seq, tier, block_id, generation, tenant, request_id,
                               expected_blocks, cpu_bytes, lossy)
    SELECT :job_id, s.seq, s.tier, s.block_id, s.generation, s.tenant, s.request_id,
           s.expected_blocks, s.cpu_bytes, s.lossy
    FROM jsonb_to_recordset(CAST(:steps AS jsonb)) AS s(
        seq int, tier text, block_id int, generation bigint, tenant text, request_id text,
        expected_blocks int, cpu_bytes bigint, lossy bool)
    """
)

_JOB = text("SELECT * FROM reclaim_jobs WHERE job_id = :job_id")
_STEPS_OF = text(
    "SELECT * FROM reclaim_steps WHERE job_id = ANY (CAST(:job_ids AS text[])) ORDER BY job_id, seq"
)
_JOB_BY_REQUEST = text("SELECT job_id FROM reclaim_jobs WHERE request_id = :request_id")

# The job's next planned step; claimed by the transaction that applies it (`_NEXT_STEP`), or only
# looked at (`_PEEK_STEP`: an owner applies it in its own batch).
_STEP_OF_JOB = """
    SELECT j.instance, j.tenant AS job_tenant, s.seq, s.tier, s.block_id, s.generation,
           s.tenant, s.request_id, s.expected_blocks, s.actual_blocks, s.bytes_before,
           s.bytes_after, s.bytes_kept
    FROM reclaim_steps s JOIN reclaim_jobs j USING (job_id)
    WHERE s.job_id = :job_id AND s.state = 'PLANNED' AND j.state IN ('PLANNED', 'RUNNING')
    ORDER BY s.seq LIMIT 1
"""
_NEXT_STEP = text(_STEP_OF_JOB + "FOR UPDATE OF s SKIP LOCKED")
_PEEK_STEP = text(_STEP_OF_JOB)
_LOCK_JOB = text("SELECT 1 FROM reclaim_jobs WHERE job_id = :job_id FOR UPDATE")

_RESERVATION_END = text(
    "SELECT state, end_reason, freed_blocks, offloaded_bytes FROM reservations "
    "WHERE tenant = :tenant AND request_id = :request_id"
)

# A step's outcome, and the job RUNNING from its first: in the driver's placeholders, so that a
# step applied in an instance's owner commits in the owner's batch (`step_done`).
STEP_DONE = """
    WITH step AS (
        UPDATE reclaim_steps SET state = %(state)s, actual_blocks = %(actual)s, note = %(note)s,
                                 applied_at = now()
        WHERE job_id = %(job_id)s AND seq = %(seq)s
        RETURNING tier, tenant
    ), counted AS (
        -- Metered for the tenant whose reservation the step took (FREE takes blocks nobody
        -- holds).
        INSERT INTO usage_events (tenant, instance, reclaimed)
        SELECT s.tenant, j.instance, jsonb_build_object(s.tier, %(actual)s)
        FROM step s JOIN reclaim_jobs j ON j.job_id = %(job_id)s
        WHERE s.tenant IS NOT NULL AND %(actual)s > 0
    )
    UPDATE reclaim_jobs SET state = 'RUNNING' WHERE job_id = %(job_id)s AND state = 'PLANNED'
"""
STEP_PROGRESS = """
    WITH step AS (
        UPDATE reclaim_steps SET actual_blocks = %(actual)s
        WHERE job_id = %(job_id)s AND seq = %(seq)s
    )
    UPDATE reclaim_jobs SET state = 'RUNNING' WHERE job_id = %(job_id)s AND state = 'PLANNED'
"""
# The instance keeps the ratio a COMPRESS step measured, for its next plans.
COMPRESSION_RATIO = (
    "UPDATE instances SET cpu_compression_ratio = %(ratio)s WHERE instance = %(instance)s"
)


_STEP_DONE = driver_statement(STEP_DONE)

_FINISH = text(
    """
    UPDATE reclaim_jobs SET state = 'SUCCEEDED', finished_at = now()
    WHERE job_id = :job_id AND state IN ('PLANNED', 'RUNNING')
      AND NOT EXISTS (
        SELECT 1 FROM reclaim_steps WHERE job_id = :job_id AND state = 'PLANNED')
    """
)

CANCEL = (
    "UPDATE reclaim_jobs SET state = 'CANCELLED', finished_at = now() "
    "WHERE job_id = %(job_id)s AND state IN ('PLANNED', 'RUNNING')"
)

_LIST_JOBS = text(
    "SELECT * FROM reclaim_jobs WHERE job_id > :after "
    "AND (CAST(:instance AS text) IS NULL OR instance = :instance) ORDER BY job_id LIMIT :size"
)

_OPEN_JOBS = text(
    "SELECT job_id FROM reclaim_jobs WHERE state IN ('PLANNED', 'RUNNING') AND NOT dry_run "
    "ORDER BY created_at LIMIT :limit"
)

# What the reclaim policy looks at: instances with work waiting, tenants over their block
# quota, and the scopes that already have a job running.
_LOADED_INSTANCES = text(
    """
    SELECT i.instance, i.capacity_blocks, c.blocks_in_use + c.pinned_blocks AS used,
           c.queued_requests
    FROM instances i JOIN instance_pool_counters c USING (instance)
    WHERE c.queued_requests > 0 AND i.state = 'ACTIVE' ORDER BY i.instance
    """
)
# A tenant in shadow mode is over its quota by design: its quota is only being tried out.
_OVER_QUOTA = text(
    "SELECT tenant, blocks_in_use - max_blocks FROM tenants "
    "WHERE state IN ('ACTIVE', 'SUSPENDED') AND blocks_in_use > max_blocks AND NOT shadow_mode "
    "ORDER BY tenant"
)
_OPEN_SCOPES = text(
    "SELECT DISTINCT instance, tenant FROM reclaim_jobs "
    "WHERE state IN ('PLANNED', 'RUNNING') AND NOT dry_run"
)

# What finished steps gave back, per instance, tier and outcome, over every job ever run (jobs
# are never deleted, so the sums only grow). Dry runs never apply a step.
_TALLIES = text(
    """
    SELECT j.instance, s.tier, s.state, count(*) AS steps,
           coalesce(sum(s.actual_blocks), 0)::bigint AS blocks,
           (coalesce(sum(s.actual_blocks), 0) * i.bytes_per_block)::bigint AS bytes
    FROM reclaim_steps s
    JOIN reclaim_jobs j USING (job_id)
    JOIN instances i ON i.instance = j.instance
    WHERE s.state IN ('APPLIED', 'SKIPPED')
    GROUP BY j.instance, s.tier, s.state, i.bytes_per_block
    ORDER BY j.instance, s.tier, s.state
    """
)

# A COMPRESS step's session, locked while the step is decided or applied.
_COMPRESSIBLE_SESSION = text(
    """
    SELECT r.offloaded_bytes, r.compressed_bytes IS NOT NULL AS compressed
    FROM reservations r
    WHERE r.tenant = :tenant AND r.request_id = :request_id
      AND r.state = 'ADMITTED' AND r.suspended_at IS NOT NULL AND r.offloaded_bytes IS NOT NULL
    FOR UPDATE
    """
)

# What the CPU tier measured, kept once: a second executor that measured too keeps the first.
_RECORD_MEASUREMENT = text(
    """
    UPDATE reclaim_steps SET bytes_before = :before, bytes_after = :after, bytes_kept = :kept
    WHERE job_id = :job_id AND seq = :seq AND state = 'PLANNED' AND tier = 'COMPRESS'
      AND bytes_before IS NULL
    """
)

# The step's own row, claimed: applying it and marking it are one transaction.
_CLAIM_STEP = text(
    """
    SELECT s.tenant, s.request_id, s.bytes_before, s.bytes_after, s.bytes_kept
    FROM reclaim_steps s JOIN reclaim_jobs j USING (job_id)
    WHERE s.job_id = :job_id AND s.seq = :seq AND s.state = 'PLANNED' AND s.tier = 'COMPRESS'
      AND s.bytes_before IS NOT NULL AND j.state IN ('PLANNED', 'RUNNING')
    FOR UPDATE OF s
    """
)

CHANGED_SINCE_PLAN = "the block was reused or evicted since the plan"
FEWER_CACHED_SINCE_PLAN = "fewer cached blocks were left than planned (reused or evicted since)"
GONE_SINCE_PLAN = "the reservation no longer exists"
NOT_SUSPENDED_ANY_MORE = "the reservation was resumed or ended since the plan"
OFFLOADED_SINCE_PLAN = "the reservation left the GPU for the CPU tier since the plan"
OVER_TENANT_CPU_QUOTA = "its tenant's CPU-tier quota has no room for it any more"
NOT_OFFLOADED_ANY_MORE = "the reservation was resumed or ended, or is not in the CPU tier"
COMPRESSED_SINCE_PLAN = "the reservation was compressed since the plan"
NOTHING_TO_DEMOTE = "the CPU tier holds none of its chunks both in L1 and compressed (unpinned)"


def ended_before_preemption(reason: str) -> str:
    return f"the reservation ended ({reason}) before it was preempted"


def _step_json(seq: int, step: PlannedStep) -> dict[str, object]:
    block_id, generation = step.block if step.block is not None else (None, None)
    tenant, request_id = step.reservation if step.reservation is not None else (None, None)
    return {
        "seq": seq,
        "tier": step.tier.name,
        "block_id": block_id,
        "generation": generation,
        "tenant": tenant,
        "request_id": request_id,
        "expected_blocks": step.gpu_blocks,
        "cpu_bytes": step.cpu_bytes,
        "lossy": step.lossy,
    }


def _exclusion_json(e: Exclusion) -> dict[str, object]:
    tenant, request_id = e.reservation if e.reservation is not None else (None, None)
    return {
        "reason": e.reason.value,
        "blocks": e.blocks,
        "tenant": tenant,
        "request_id": request_id,
    }


def _exclusion(value: dict[str, Any]) -> Exclusion:
    reservation = None
    if value["tenant"] is not None:
        reservation = (value["tenant"], value["request_id"])
    return Exclusion(Unreclaimable(value["reason"]), value["blocks"], reservation)


def _job_step(row: RowMapping) -> JobStep:
    block = None if row["block_id"] is None else (row["block_id"], row["generation"])
    reservation = None if row["tenant"] is None else (row["tenant"], row["request_id"])
    tier, expected = Tier[row["tier"]], row["expected_blocks"]
    planned = PlannedStep(tier, block, reservation, expected, row["cpu_bytes"], row["lossy"])
    return JobStep(row["seq"], planned, StepState(row["state"]), row["actual_blocks"], row["note"])


async def _load_jobs(
    conn: AsyncConnection, jobs: TextClause, args: dict[str, object]
) -> list[ReclaimJob]:
    """The jobs `jobs` selects, in its order, with their steps: two queries for any number."""
    rows = (await conn.execute(jobs, args)).mappings().all()
    if not rows:
        return []
    steps: dict[str, list[JobStep]] = {row["job_id"]: [] for row in rows}
    job_ids = list(steps)
    for step in (await conn.execute(_STEPS_OF, {"job_ids": job_ids})).mappings():
        steps[step["job_id"]].append(_job_step(step))
    return [
        ReclaimJob(
            row["job_id"],
            row["request_id"],
            row["instance"],
            ReclaimTarget(
                row["target_blocks"],
                Tier[row["max_tier"]],
                row["tenant"],
                Tier[row["min_tier"]],
            ),
            row["dry_run"],
            JobState(row["state"]),
            row["expected_blocks"],
            tuple(_exclusion(e) for e in row["excluded"]),
            tuple(steps[row["job_id"]]),
        )
        for row in rows
    ]


def _same_request(
    job: ReclaimJob, instance: str, target: ReclaimTarget, dry_run: bool
) -> ReclaimJob:
    """A repeated request_id returns its job only when it asks for the same thing."""
    if (job.instance, job.target, job.dry_run) != (instance, target, dry_run):
        raise KvQuotaError(
            Reason.REQUEST_ID_REUSED,
            f"request_id {job.request_id!r} already created {reclaim_job_name(job.job_id)} "
            "with different parameters",
            metadata={"requestId": job.request_id, "name": reclaim_job_name(job.job_id)},
        )
    return job


class ReclaimJobs:
    """Reclaim jobs: stored with their steps, executed by any replica (each step by the owner
    of its instance)."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine

    async def created_by(
        self, request_id: str, instance: str, target: ReclaimTarget, dry_run: bool
    ) -> ReclaimJob | None:
        """The job `request_id` created already, if any (REQUEST_ID_REUSED when that asked for
        something else)."""
        async with self._engine.connect() as conn:
            existing = (await conn.execute(_JOB_BY_REQUEST, {"request_id": request_id})).first()
        if existing is None:
            return None
        return _same_request(await self.get(existing[0]), instance, target, dry_run)

    async def add(
        self,
        request_id: str,
        instance: str,
        target: ReclaimTarget,
        dry_run: bool,
        planned: ReclaimPlan,
    ) -> ReclaimJob:
        """Store a job with its plan (a dry run finished at once); when `request_id` raced us
        in, the job it created."""
        job_id = f"reclaim-{secrets.token_hex(8)}"

        async def work(conn: AsyncConnection) -> str:
            inserted = await conn.execute(
                _INSERT_JOB,
                {
                    "job_id": job_id,
                    "request_id": request_id,
                    "instance": instance,
                    "tenant": target.tenant,
                    "target_blocks": target.target_blocks,
                    "max_tier": target.max_tier.name,
                    "min_tier": target.min_tier.name,
                    "dry_run": dry_run,
                    "state": (JobState.SUCCEEDED if dry_run else JobState.PLANNED).value,
                    "expected_blocks": planned.total_blocks,
                    "excluded": json.dumps([_exclusion_json(e) for e in planned.excluded]),
                },
            )
            if inserted.first() is None:  # the same request_id raced us in
                raced = await conn.execute(_JOB_BY_REQUEST, {"request_id": request_id})
                return str(raced.scalar_one())
            steps = [_step_json(seq, s) for seq, s in enumerate(planned.steps)]
            if steps:
                await conn.execute(_INSERT_STEPS, {"job_id": job_id, "steps": json.dumps(steps)})
            return job_id

        job = await self.get(await in_transaction(self._engine, work))
        return _same_request(job, instance, target, dry_run)

    async def next_step(self, job_id: str) -> RowMapping | None:
        """The job's next planned step as it is now (None: none left), without claiming it."""
        async with self._engine.connect() as conn:
            return (await conn.execute(_PEEK_STEP, {"job_id": job_id})).mappings().first()

    async def claimed_compression(self, job_id: str, seq: int) -> CompressMeasurement | None:
        """What a COMPRESS step measured, while it is planned and its job open."""
        async with self._engine.connect() as conn:
            found = await conn.execute(_CLAIM_STEP, {"job_id": job_id, "seq": seq})
            claimed = found.mappings().first()
            await conn.rollback()
        return None if claimed is None else _measurement(claimed)

    async def get(self, job_id: str) -> ReclaimJob:
        async with self._engine.connect() as conn:
            found = await _load_jobs(conn, _JOB, {"job_id": job_id})
        if not found:
            raise not_found(Reason.RECLAIM_JOB_NOT_FOUND, reclaim_job_name(job_id))
        return found[0]

    async def list_jobs(self, page: Page, instance: str | None = None) -> list[ReclaimJob]:
        args = {"after": page.after or "", "size": page.size, "instance": instance}
        async with self._engine.connect() as conn:
            return await _load_jobs(conn, _LIST_JOBS, args)

    async def run_reservation_step(self, job_id: str) -> bool | Preemption | Demotion:
        """Apply the job's next planned step, a COMPRESS or EVICT step (they read their
        reservation's row and change nothing of the pool), in one transaction with its
        bookkeeping (a crash leaves it planned, never half-applied). True: it was applied, or
        skipped with its reason; False: none is left and the job is finished; a Preemption:
        the step's reservation still runs, and nothing changed — the engine must abort it
        first; a Demotion: the step's session is to be demoted in the CPU tier first
        (`compress` applies it then)."""

        async def work(conn: AsyncConnection) -> bool | Preemption | Demotion:
            # The job row first: a cancel that commits while a step is claimed must not see
            # that step applied after it returned.
            await conn.execute(_LOCK_JOB, {"job_id": job_id})
            step = (await conn.execute(_NEXT_STEP, {"job_id": job_id})).mappings().first()
            if step is None:
                await conn.execute(_FINISH, {"job_id": job_id})
                return False
            outcome: _StepResult | Preemption | Demotion
            if step["tier"] == Tier.COMPRESS.name:
                outcome = await _compressible(conn, step)
            else:
                assert step["tier"] == Tier.EVICT.name, f"{step['tier']} is its owner's to apply"
                outcome = await _preempted(conn, step)
            if isinstance(outcome, Preemption | Demotion):
                return outcome
            await _step_done(conn, job_id, step["seq"], outcome)
            return True

        return await in_transaction(self._engine, work)

    async def record_measurement(
        self, job_id: str, seq: int, measured: CompressMeasurement
    ) -> CompressMeasurement | None:
        """Keep what the CPU tier measured of a COMPRESS step's session, before its chunks
        leave L1; returns the measurement the step keeps (the first one recorded), or None
        when the step is no longer planned."""

        async def work(conn: AsyncConnection) -> CompressMeasurement | None:
            args = {
                "job_id": job_id,
                "seq": seq,
                "before": measured.before_bytes,
                "after": measured.after_bytes,
                "kept": measured.kept_bytes,
            }
            await conn.execute(_RECORD_MEASUREMENT, args)
            row = (await conn.execute(_CLAIM_STEP, args)).mappings().first()
            return None if row is None else _measurement(row)

        return await in_transaction(self._engine, work)

    async def loads_and_open_scopes(
        self,
    ) -> tuple[list[InstanceLoad], set[tuple[str, str | None]]]:
        """Instances with work waiting, and the (instance, tenant) scopes that have a job
        open."""
        async with self._engine.connect() as conn:
            loads = [InstanceLoad(*row) for row in await conn.execute(_LOADED_INSTANCES)]
            open_scopes = {(i, t) for i, t in await conn.execute(_OPEN_SCOPES)}
        return loads, open_scopes

    async def cpu_room(self, tenant: str) -> int:
        """The CPU-tier bytes the tenant's quota still allows, over every instance."""
        async with self._engine.connect() as conn:
            room = await conn.execute(_CPU_ROOM_OF_TENANT, {"tenant": tenant})
            return int(room.scalar_one())

    async def finish_if_done(self, job_id: str) -> None:
        """SUCCEEDED once no step is left planned."""
        async with self._engine.begin() as conn:
            await conn.execute(_FINISH, {"job_id": job_id})

    async def tenants_over_quota(self) -> list[tuple[str, int]]:
        """Tenants over their block quota (not in shadow mode), and by how many blocks."""
        async with self._engine.connect() as conn:
            return [(t, excess) for t, excess in await conn.execute(_OVER_QUOTA)]

    async def tallies(self) -> list[ReclaimTally]:
        """Blocks (and their GPU bytes) that applied steps gave back, and the steps skipped,
        per instance and tier, over every job."""
        async with self._engine.connect() as conn:
            return [
                ReclaimTally(
                    r.instance, Tier[r.tier], StepState(r.state), r.steps, r.blocks, r.bytes
                )
                for r in await conn.execute(_TALLIES)
            ]

    async def open_jobs(self, limit: int) -> list[str]:
        """Jobs still to execute, oldest first."""
        async with self._engine.connect() as conn:
            return list((await conn.execute(_OPEN_JOBS, {"limit": limit})).scalars().all())


# What a finished step gave back, and why not what was planned (None: applied as planned).
_StepResult = tuple[int, str | None]


def step_done(job_id: str, seq: int, outcome: _StepResult) -> dict[str, object]:
    """STEP_DONE's parameters for a step's outcome."""
    actual, note = outcome
    state = StepState.SKIPPED if note is not None and actual == 0 else StepState.APPLIED
    return {"job_id": job_id, "seq": seq, "state": state.value, "actual": actual, "note": note}


async def _step_done(conn: AsyncConnection, job_id: str, seq: int, outcome: _StepResult) -> None:
    await conn.execute(_STEP_DONE, step_done(job_id, seq, outcome))


def _measurement(row: RowMapping) -> CompressMeasurement:
    return CompressMeasurement(row["bytes_before"], row["bytes_after"], row["bytes_kept"])


async def _compressible(conn: AsyncConnection, step: RowMapping) -> _StepResult | Demotion:
    """COMPRESS: skipped when its session left the CPU tier or was compressed meanwhile;
    otherwise the CPU tier demotes it first (measuring it, unless that was done already)."""
    keys = {"tenant": step["tenant"], "request_id": step["request_id"]}
    session = (await conn.execute(_COMPRESSIBLE_SESSION, keys)).mappings().first()
    if session is None:
        return 0, NOT_OFFLOADED_ANY_MORE
    if session["compressed"]:
        return 0, COMPRESSED_SINCE_PLAN
    measured = None if step["bytes_before"] is None else _measurement(step)
    return Demotion(step["seq"], step["tenant"], step["request_id"], measured)


async def _preempted(
    conn: AsyncConnection, step: RowMapping
) -> tuple[int, str | None] | Preemption:
    """EVICT: done once the reservation ended preempted (with the blocks its end freed)."""
    keys = {"tenant": step["tenant"], "request_id": step["request_id"]}
    row = (await conn.execute(_RESERVATION_END, keys)).mappings().first()
    if row is None:
        return 0, GONE_SINCE_PLAN
    if row["offloaded_bytes"] is not None and row["state"] != ReservationState.ENDED.value:
        return 0, OFFLOADED_SINCE_PLAN
    if row["state"] != ReservationState.ENDED.value:
        return Preemption(step["tenant"], step["request_id"])
    if row["end_reason"] != EndReason.PREEMPTED.value:
        return 0, ended_before_preemption(row["end_reason"])
    return int(row["freed_blocks"] or 0), None
