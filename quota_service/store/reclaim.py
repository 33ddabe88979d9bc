"""Reclaim jobs in the ledger. A plan starts from one consistent snapshot of an instance's pool
(one repeatable-read transaction, so cached blocks, block tables and pins agree), counted in SQL
so that its size does not grow with the pool's; the job and its steps are stored, and each step is
applied in the transaction that marks it done (a FREE step a batch of blocks per transaction)."""

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
from quota_service.core.names import reclaim_job_name, tenant_name
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
    SharedEntry,
    StepState,
    TenantExcess,
    Tier,
    Unreclaimable,
    check_target,
    cpu_tier,
    plan,
)
from quota_service.store import blocks, ledger
from quota_service.store.catalog import Catalog
from quota_service.store.cpu_tier import COMPRESSIBLE
from quota_service.store.database import driver_statement, in_transaction

# Blocks no reservation references, by state (CACHED, or PINNED: only pins hold them) and by
# whose salt hashed them: one scan of the pool, a row per scope.
_UNREFERENCED = text(
    """
    SELECT state, hash_scope, count(*) AS blocks FROM blocks
    WHERE instance = :instance AND state IN ('CACHED', 'PINNED')
    GROUP BY state, hash_scope ORDER BY state, hash_scope
    """
)

# Each admitted reservation holding blocks, with its table's length. Only entries naming blocks
# that have other references too (ref_count > 1: pinned, or shared) are looked at one by one;
# the rest, most of a pool, are its alone and only counted.
_LIVE = text(
    """
    WITH live AS (
        SELECT holder_id, tenant, request_id, priority, suspended_at IS NOT NULL AS suspended,
               row_number() OVER (ORDER BY admitted_at, holder_id) AS admitted_seq
        FROM reservations WHERE instance = :instance AND state = 'ADMITTED'
    ), tables AS (
        SELECT holder_id, count(*) AS entries FROM block_refs
        WHERE instance = :instance AND NOT released
        GROUP BY holder_id
    ), multi AS (
        SELECT ref.holder_id, count(*) FILTER (WHERE b.pin_count > 0) AS pinned_entries,
               array_agg(ARRAY[ref.block_id, ref.generation, b.ref_count])
                   FILTER (WHERE b.pin_count = 0) AS shared
        FROM blocks b
        JOIN block_refs ref
          ON ref.instance = b.instance AND ref.block_id = b.block_id AND NOT ref.released
        WHERE b.instance = :instance AND b.ref_count > 1
        GROUP BY ref.holder_id
    )
    SELECT l.tenant, l.request_id, l.priority, l.admitted_seq, l.suspended, t.entries,
           coalesce(m.pinned_entries, 0) AS pinned_entries, m.shared
    FROM live l JOIN tables t USING (holder_id) LEFT JOIN multi m USING (holder_id)
    ORDER BY l.admitted_seq
    """
)


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

# Whether an OFFLOAD still fits in its tenant's quota, read under the tenant's row lock (two
# offloads of one tenant on two instances must not both fit in the same room).
# (No row: it cannot be offloaded any more, whatever the quota.)
_FITS_TENANT_CPU_QUOTA = text(
    f"""
    SELECT {ledger.OFFLOADED_BYTES} <= {_CPU_ROOM_OF_T}
    FROM reservations r
    JOIN instances i ON i.instance = r.instance
    JOIN tenants t ON t.tenant = r.tenant
    WHERE r.tenant = :tenant AND r.request_id = :request_id AND {ledger.OFFLOADABLE}
    """
)


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
    watermarks: CpuWatermarks = DEFAULT_WATERMARKS,
    blocks: PoolBlocks | None = None,
) -> PoolSnapshot:
    """The instance's pool as the planner sees it, with its CPU tier as last read. `blocks`:
    its slots as read elsewhere (its owner's memory); None: from the per-block tables."""
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
        if blocks is None:
            blocks = await _pool_blocks(conn, instance)
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


async def _pool_blocks(conn: AsyncConnection, instance: str) -> PoolBlocks:
    args = {"instance": instance}
    unreferenced = (await conn.execute(_UNREFERENCED, args)).all()
    reservations = tuple(
        LiveReservation(
            r.tenant,
            r.request_id,
            r.priority,
            r.admitted_seq,
            r.suspended,
            r.entries,
            r.pinned_entries,
            tuple(SharedEntry(*entry) for entry in r.shared or ()),
        )
        for r in await conn.execute(_LIVE, args)
    )
    cached = tuple(CachedScope(r.hash_scope, r.blocks) for r in unreferenced if r.state == "CACHED")
    pinned = tuple((r.hash_scope, r.blocks) for r in unreferenced if r.state == "PINNED")
    return PoolBlocks(cached, reservations, pinned)


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

# The next planned step of a running job, claimed so that replicas work on different steps.
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

_FREE_BLOCK = text(
    blocks.drop_contents(
        "SELECT block_id, state, content_hash FROM blocks WHERE instance = :instance "
        "AND block_id = :block_id AND generation = :generation AND state = 'CACHED'",
        "RECLAIMED",
    )
)

# The next cached blocks of a FREE step, least damage first: those of scopes with no live
# reservation on the instance (no request is about to hit them) before the others, least
# recently used first within each, as vLLM evicts; only the job's tenant's own when it has one.
_FREE_CACHED = text(
    blocks.drop_contents(
        """
        WITH active AS (
            SELECT s.scope FROM reservations r JOIN tenants t USING (tenant)
            CROSS JOIN LATERAL unnest(ARRAY['tenants/' || t.tenant, 'namespaces/' || t.namespace])
                AS s(scope)
            WHERE r.instance = :instance AND r.state = 'ADMITTED' AND s.scope IS NOT NULL
        )
        SELECT block_id, state, content_hash FROM blocks
        WHERE instance = :instance AND state = 'CACHED'
          AND (CAST(:scope AS text) IS NULL OR hash_scope = :scope)
        ORDER BY coalesce(hash_scope IN (SELECT scope FROM active), false), lru_seq
        LIMIT :batch
        """,
        "RECLAIMED",
    )
)

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
_STEP_PROGRESS = driver_statement(STEP_PROGRESS)

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
_CANCEL = driver_statement(CANCEL)

_LIST_JOBS = text(
    "SELECT * FROM reclaim_jobs WHERE job_id > :after "
    "AND (CAST(:instance AS text) IS NULL OR instance = :instance) ORDER BY job_id LIMIT :size"
)

_OPEN_JOBS = text(
    "SELECT job_id FROM reclaim_jobs WHERE state IN ('PLANNED', 'RUNNING') AND NOT dry_run "
    "ORDER BY created_at LIMIT :limit"
)

# What the reclaim policy looks at: instances with work waiting, tenants over their block
# quota (and where they hold blocks), and the scopes that already have a job running.
_LOADED_INSTANCES = text(
    """
    SELECT instance, capacity_blocks, blocks_in_use + pinned_blocks AS used, queued_requests
    FROM instances WHERE queued_requests > 0 AND state = 'ACTIVE' ORDER BY instance
    """
)
_TENANTS_OVER_QUOTA = text(
    """
    SELECT t.tenant, t.blocks_in_use - t.max_blocks AS excess,
           array_agg(tb.instance ORDER BY tb.instance) AS instances,
           array_agg(tb.held ORDER BY tb.instance) AS held
    FROM tenants t
    JOIN (SELECT tenant, instance, count(*) AS held FROM tenant_blocks
          GROUP BY tenant, instance) tb USING (tenant)
    -- A tenant in shadow mode is over its quota by design: its quota is only being tried out.
    WHERE t.state IN ('ACTIVE', 'SUSPENDED') AND t.blocks_in_use > t.max_blocks
      AND NOT t.shadow_mode
    GROUP BY t.tenant, t.blocks_in_use, t.max_blocks ORDER BY t.tenant
    """
)
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

# The session now holds `compressed` bytes in the compressed tier and `kept` in the CPU tier;
# usage follows, and the instance keeps the ratio measured for its next plans.
_COMPRESS_SESSION = text(
    """
    WITH session AS (
        UPDATE reservations
        SET offloaded_bytes = :kept, compressed_bytes = :compressed,
            compress_before_bytes = :before, compress_after_bytes = :after
        WHERE tenant = :tenant AND request_id = :request_id
        RETURNING tenant, instance
    ), counted AS (
        INSERT INTO usage_events (tenant, instance, cpu_bytes, compressed_bytes)
        SELECT tenant, instance, CAST(:kept AS bigint) - CAST(:offloaded AS bigint),
               :compressed
        FROM session
    )
    UPDATE instances i SET cpu_compression_ratio = :ratio
    FROM session s WHERE i.instance = s.instance
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


# Cached blocks a FREE step frees per transaction: each holds the instance's lock (admissions
# on it wait), so a large step gives way between batches.
FREE_BATCH_BLOCKS = 1024


class ReclaimJobs:
    """Reclaim jobs: planned from a snapshot, stored step by step, executed by any replica."""

    def __init__(
        self,
        engine: AsyncEngine,
        watermarks: CpuWatermarks = DEFAULT_WATERMARKS,
        free_batch_blocks: int = FREE_BATCH_BLOCKS,
    ) -> None:
        self._engine = engine
        self._watermarks = watermarks
        self._free_batch_blocks = free_batch_blocks

    async def create(
        self, request_id: str, instance: str, target: ReclaimTarget, dry_run: bool
    ) -> ReclaimJob:
        """Plan and store a job; a repeat of `request_id` returns the job it created."""
        check_target(target)
        async with self._engine.connect() as conn:
            existing = (await conn.execute(_JOB_BY_REQUEST, {"request_id": request_id})).first()
        if existing is not None:
            return _same_request(await self.get(existing[0]), instance, target, dry_run)
        if target.tenant is not None:
            await Catalog(self._engine).get_tenant(target.tenant)  # NOT_FOUND for no tenant
        result = await self.preview(instance, target)
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
                    "expected_blocks": result.total_blocks,
                    "excluded": json.dumps([_exclusion_json(e) for e in result.excluded]),
                },
            )
            if inserted.first() is None:  # the same request_id raced us in
                raced = await conn.execute(_JOB_BY_REQUEST, {"request_id": request_id})
                return str(raced.scalar_one())
            steps = [_step_json(seq, s) for seq, s in enumerate(result.steps)]
            if steps:
                await conn.execute(_INSERT_STEPS, {"job_id": job_id, "steps": json.dumps(steps)})
            return job_id

        job = await self.get(await in_transaction(self._engine, work))
        return _same_request(job, instance, target, dry_run)

    async def preview(self, instance: str, target: ReclaimTarget) -> ReclaimPlan:
        """The plan a job would get now, stored nowhere."""
        check_target(target)
        blocks = await self._pool_blocks(instance)
        return plan(await load_snapshot(self._engine, instance, self._watermarks, blocks), target)

    async def _pool_blocks(self, instance: str) -> PoolBlocks | None:
        """The instance's slots when something else than the per-block tables holds them."""
        return None

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

    async def cancel(self, job_id: str) -> ReclaimJob:
        """Stop a job: steps applied stay applied, the others are never run. Cancelling a
        finished job changes nothing and returns it."""
        async with self._engine.begin() as conn:
            await conn.execute(_CANCEL, {"job_id": job_id})
        return await self.get(job_id)

    async def list_jobs(self, page: Page, instance: str | None = None) -> list[ReclaimJob]:
        args = {"after": page.after or "", "size": page.size, "instance": instance}
        async with self._engine.connect() as conn:
            return await _load_jobs(conn, _LIST_JOBS, args)

    async def run_step(self, job_id: str) -> bool | Preemption | Demotion:
        """Apply the job's next planned step in one transaction with its bookkeeping (a crash
        leaves it planned, never half-applied; a FREE step applies a batch of its blocks per
        call, with its progress). True: a step (or a batch) was applied, or skipped with its
        reason; False: none is left and the job is finished; a Preemption: the step's
        reservation still runs, and nothing changed — the engine must abort it first; a
        Demotion: the step's session is to be demoted in the CPU tier first (`compress`
        applies it then)."""

        async def work(conn: AsyncConnection) -> bool | Preemption | Demotion:
            # The job row first: a cancel that commits while a step is claimed must not see
            # that step applied after it returned.
            await conn.execute(_LOCK_JOB, {"job_id": job_id})
            step = (await conn.execute(_NEXT_STEP, {"job_id": job_id})).mappings().first()
            if step is None:
                await conn.execute(_FINISH, {"job_id": job_id})
                return False
            outcome: _StepResult | _Progress | Preemption | Demotion
            if step["tier"] == Tier.FREE.name and step["block_id"] is not None:
                outcome = await _free_block(conn, step)
            elif step["tier"] == Tier.FREE.name:
                outcome = await _free_cached(conn, step, self._free_batch_blocks)
            elif step["tier"] == Tier.OFFLOAD.name:
                outcome = await _offloaded(conn, step)
            elif step["tier"] == Tier.COMPRESS.name:
                outcome = await _compressible(conn, step)
            else:
                outcome = await _preempted(conn, step)
            if isinstance(outcome, Preemption | Demotion):
                return outcome
            if isinstance(outcome, _Progress):
                progress = {"job_id": job_id, "seq": step["seq"], "actual": outcome.blocks}
                await conn.execute(_STEP_PROGRESS, progress)
                return True
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

    async def compress(self, job_id: str, seq: int) -> bool:
        """Apply a COMPRESS step whose session the CPU tier demoted: its bytes move to the
        compressed tier by what was measured, in the transaction that marks the step, so a
        step is applied once however often it is retried. False: the step was no longer
        planned (applied or skipped already, or its job cancelled)."""

        async def work(conn: AsyncConnection) -> bool:
            await conn.execute(_LOCK_JOB, {"job_id": job_id})
            step = (await conn.execute(_CLAIM_STEP, {"job_id": job_id, "seq": seq})).mappings()
            claimed = step.first()
            if claimed is None:
                return False
            measured = _measurement(claimed)
            keys = {"tenant": claimed["tenant"], "request_id": claimed["request_id"]}
            session = (await conn.execute(_COMPRESSIBLE_SESSION, keys)).mappings().first()
            outcome: _StepResult = (0, None)
            if session is None:
                outcome = (0, NOT_OFFLOADED_ANY_MORE)
            elif session["compressed"]:
                outcome = (0, COMPRESSED_SINCE_PLAN)
            elif not measured.before_bytes:
                outcome = (0, NOTHING_TO_DEMOTE)
            else:
                kept, compressed = measured.booked(session["offloaded_bytes"])
                args = {
                    **keys,
                    "offloaded": session["offloaded_bytes"],
                    "kept": kept,
                    "compressed": compressed,
                    "before": measured.before_bytes,
                    "after": measured.after_bytes,
                    "ratio": measured.ratio,
                }
                await conn.execute(_COMPRESS_SESSION, args)
            await _step_done(conn, job_id, seq, outcome)
            return True

        return await in_transaction(self._engine, work)

    async def policy_inputs(
        self,
    ) -> tuple[list[InstanceLoad], list[TenantExcess], set[tuple[str, str | None]]]:
        """Instances with work waiting, tenants over their block quota, and the (instance,
        tenant) scopes that have a job open."""
        async with self._engine.connect() as conn:
            loads = [InstanceLoad(*row) for row in await conn.execute(_LOADED_INSTANCES)]
            open_scopes = {(i, t) for i, t in await conn.execute(_OPEN_SCOPES)}
        return loads, await self.tenant_excesses(), open_scopes

    async def tenant_excesses(self) -> list[TenantExcess]:
        """Tenants over their block quota, with what they hold on each instance."""
        async with self._engine.connect() as conn:
            return [
                TenantExcess(tenant, excess, tuple(zip(instances, held, strict=True)))
                for tenant, excess, instances, held in await conn.execute(_TENANTS_OVER_QUOTA)
            ]

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


@dataclass(frozen=True, slots=True)
class _Progress:
    """A FREE step's blocks freed so far, more to come."""

    blocks: int


async def _free_cached(
    conn: AsyncConnection, step: RowMapping, batch: int
) -> _StepResult | _Progress:
    """FREE: the next batch of the step's cached blocks, until it has freed what was planned or
    no cached block is left to it (reused or evicted since the plan)."""
    await conn.execute(blocks.LOCK_INSTANCE, {"instance": step["instance"]})
    done, planned = step["actual_blocks"] or 0, step["expected_blocks"]
    asked = min(batch, planned - done)
    tenant = step["job_tenant"]
    args = {
        "instance": step["instance"],
        "scope": None if tenant is None else tenant_name(tenant),
        "batch": asked,
    }
    freed = int((await conn.execute(_FREE_CACHED, args)).mappings().one()["freed"])
    done += freed
    if done == planned:
        return done, None
    if freed < asked:
        return done, FEWER_CACHED_SINCE_PLAN
    return _Progress(done)


async def _free_block(conn: AsyncConnection, step: RowMapping) -> _StepResult:
    """FREE, as planned before FREE steps were counted (such jobs may still be open): drop the
    one cached block's contents, unless it was reused or evicted meanwhile."""
    await conn.execute(blocks.LOCK_INSTANCE, {"instance": step["instance"]})
    args = {
        "instance": step["instance"],
        "block_id": step["block_id"],
        "generation": step["generation"],
    }
    freed = int((await conn.execute(_FREE_BLOCK, args)).mappings().one()["freed"])
    return freed, None if freed else CHANGED_SINCE_PLAN


async def _offloaded(conn: AsyncConnection, step: RowMapping) -> _StepResult:
    """OFFLOAD: the suspended reservation's blocks leave the GPU, unless it was resumed or
    ended meanwhile, or its tenant's CPU-tier quota has no room for them any more."""
    keys = {"instance": step["instance"], "tenant": step["tenant"]}
    await conn.execute(blocks.LOCK_INSTANCE, keys)
    await conn.execute(blocks.LOCK_TENANT, keys)
    fits = await conn.execute(_FITS_TENANT_CPU_QUOTA, {**keys, "request_id": step["request_id"]})
    if fits.scalar_one_or_none() is False:
        return 0, OVER_TENANT_CPU_QUOTA
    freed = await ledger.offload(conn, step["instance"], step["tenant"], step["request_id"])
    return (0, NOT_SUSPENDED_ANY_MORE) if freed is None else (freed, None)


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
