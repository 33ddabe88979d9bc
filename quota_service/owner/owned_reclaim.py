"""Reclaim jobs on instances served from memory: plans read the pool from its owner, and FREE,
OFFLOAD and COMPRESS steps change the owner's machine in the same batch that marks them
applied (a crash leaves a step planned with nothing done, or applied with all of it). EVICT
steps need nothing of the machine but what ending a reservation does, and COMPRESS steps first
ask the CPU tier to demote their session: both are decided from the reservation's row
(store/reclaim.py)."""

from __future__ import annotations

import asyncio
from collections import Counter
from itertools import compress, repeat
from operator import gt

from sqlalchemy.engine import RowMapping
from sqlalchemy.ext.asyncio import AsyncEngine

from quota_service.core.instance_machine import InstanceMachine
from quota_service.core.names import tenant_name
from quota_service.core.reclaim import (
    DEFAULT_WATERMARKS,
    CachedScope,
    CpuWatermarks,
    Demotion,
    InstanceLoad,
    LiveReservation,
    Preemption,
    ReclaimJob,
    ReclaimPlan,
    ReclaimTarget,
    SharedEntry,
    TenantExcess,
    Tier,
    check_target,
    plan,
)
from quota_service.owner.owners import Owners
from quota_service.store.catalog import Catalog
from quota_service.store.journal import Statement
from quota_service.store.reclaim import (
    CANCEL,
    CHANGED_SINCE_PLAN,
    COMPRESSED_SINCE_PLAN,
    COMPRESSION_RATIO,
    FEWER_CACHED_SINCE_PLAN,
    NOT_OFFLOADED_ANY_MORE,
    NOT_SUSPENDED_ANY_MORE,
    NOTHING_TO_DEMOTE,
    OVER_TENANT_CPU_QUOTA,
    STEP_DONE,
    STEP_PROGRESS,
    PoolBlocks,
    ReclaimJobs,
    load_snapshot,
    step_done,
)

# Cached blocks a FREE step frees per batch of its instance's owner: the step's blocks leave
# the machine while no other operation on the instance runs, so a large step gives way between
# batches.
FREE_BATCH_BLOCKS = 1024


class OwnedReclaimJobs(ReclaimJobs):
    def __init__(
        self,
        engine: AsyncEngine,
        owners: Owners,
        watermarks: CpuWatermarks = DEFAULT_WATERMARKS,
        free_batch_blocks: int = FREE_BATCH_BLOCKS,
    ) -> None:
        super().__init__(engine)
        self._owners = owners
        self._watermarks = watermarks
        self._free_batch_blocks = free_batch_blocks
        # A FREE or OFFLOAD step is read from the record before its batch is applied in
        # memory: two executors of a job (or a cancel) between the two would apply it twice
        # (or after the cancel returned). In the instance's owner, a job runs a step at a time.
        self._job_locks: dict[str, asyncio.Lock] = {}

    async def create(
        self, request_id: str, instance: str, target: ReclaimTarget, dry_run: bool
    ) -> ReclaimJob:
        """Plan and store a job; a repeat of `request_id` returns the job it created."""
        check_target(target)
        existing = await self.created_by(request_id, instance, target, dry_run)
        if existing is not None:
            return existing
        if target.tenant is not None:
            await Catalog(self._engine).get_tenant(target.tenant)  # NOT_FOUND for no tenant
        planned = await self.preview(instance, target)
        return await self.add(request_id, instance, target, dry_run, planned)

    async def preview(self, instance: str, target: ReclaimTarget) -> ReclaimPlan:
        """The plan a job would get now, stored nowhere."""
        check_target(target)
        blocks = await self._owners.run(instance, lambda m, now: pool_blocks(m))
        return plan(await load_snapshot(self._engine, instance, blocks, self._watermarks), target)

    async def policy_inputs(
        self,
    ) -> tuple[list[InstanceLoad], list[TenantExcess], set[tuple[str, str | None]]]:
        """Instances with work waiting, tenants over their block quota, and the (instance,
        tenant) scopes that have a job open."""
        loads, open_scopes = await self.loads_and_open_scopes()
        return loads, await self.tenant_excesses(), open_scopes

    async def tenant_excesses(self) -> list[TenantExcess]:
        """Tenants over their block quota, with what they hold on each instance (here from
        the machines, elsewhere as the record has it)."""
        over = await self.tenants_over_quota()
        if not over:
            return []
        served = self._owners.served()
        elsewhere = await self._owners.holdings_elsewhere()
        excesses = []
        for tenant, excess in over:
            held = {
                owner.instance: here.blocks
                for owner in served
                if (here := owner.machine.tenants.get(tenant)) is not None and here.blocks
            }
            for instance, totals in elsewhere.get(tenant, {}).items():
                if totals.blocks:
                    held[instance] = totals.blocks
            excesses.append(TenantExcess(tenant, excess, tuple(sorted(held.items()))))
        return excesses

    async def run_step(self, job_id: str) -> bool | Preemption | Demotion:
        """Apply the job's next planned step (a FREE step a batch of its blocks per call).
        True: a step (or a batch) was applied, or skipped with its reason; False: none is left
        and the job is finished; a Preemption or a Demotion: what must happen first
        (`ReclaimJobs.run_reservation_step`)."""
        async with self._job_locks.setdefault(job_id, asyncio.Lock()):
            ran = await self._run_step(job_id)
        if ran is False:
            self._job_locks.pop(job_id, None)
        return ran

    async def cancel(self, job_id: str) -> ReclaimJob:
        """Cancelled in the batches of the job's instance, after the step under way: from
        when this returns, no step of the job is applied (its owner's next read finds it
        cancelled, and a stale owner's batch fails its epoch check)."""
        instance = (await self.get(job_id)).instance
        async with self._job_locks.setdefault(job_id, asyncio.Lock()):
            cancel = (CANCEL, {"job_id": job_id})
            await self._owners.run(instance, lambda machine, now: None, lambda _: [cancel])
        return await self.get(job_id)

    async def _run_step(self, job_id: str) -> bool | Preemption | Demotion:
        step = await self.next_step(job_id)
        if step is None:
            await self.finish_if_done(job_id)
            return False
        if step["tier"] == Tier.FREE.name:
            await self._free(job_id, step)
            return True
        if step["tier"] == Tier.OFFLOAD.name:
            await self._offload(job_id, step)
            return True
        # COMPRESS and EVICT read the reservation's row and change nothing here.
        return await self.run_reservation_step(job_id)

    async def _free(self, job_id: str, step: RowMapping) -> None:
        """FREE: the next batch of the step's cached blocks, least recently used first and
        those of tenants with work here last, until it freed what was planned or none is left
        to it."""
        done, planned = step["actual_blocks"] or 0, step["expected_blocks"]
        if step["block_id"] is not None:  # one block, as planned before FREE steps counted
            statement = (STEP_DONE, step_done(job_id, step["seq"], (0, CHANGED_SINCE_PLAN)))
            await self._owners.run(step["instance"], lambda m, now: None, lambda _: [statement])
            return
        asked = min(self._free_batch_blocks, planned - done)
        tenant = step["job_tenant"]
        scope = None if tenant is None else tenant_name(tenant)

        def free(machine: InstanceMachine, now: float) -> int:
            return machine.free_cached(asked, scope, machine.active_scopes())

        def marked(freed: int) -> list[Statement]:
            total = done + freed
            if total == planned or freed < asked:
                note = None if total == planned else FEWER_CACHED_SINCE_PLAN
                return [(STEP_DONE, step_done(job_id, step["seq"], (total, note)))]
            progress = {"job_id": job_id, "seq": step["seq"], "actual": total}
            return [(STEP_PROGRESS, progress)]

        await self._owners.run(step["instance"], free, marked)

    async def _offload(self, job_id: str, step: RowMapping) -> None:
        """OFFLOAD: the suspended reservation's blocks leave the GPU, unless it was resumed or
        ended meanwhile, or its tenant's CPU-tier quota has no room for them any more."""
        tenant, request_id, seq = step["tenant"], step["request_id"], step["seq"]
        room = await self.cpu_room(tenant)

        def offload(machine: InstanceMachine, now: float) -> tuple[int, str | None]:
            record = machine.reservations.get((tenant, request_id))
            if record is None or not record.on_gpu or record.suspended_at is None:
                return 0, NOT_SUSPENDED_ANY_MORE
            assert record.table is not None
            held = (machine.spec.bytes_per_block or 0) * record.table.live_entries
            if held > room:
                return 0, OVER_TENANT_CPU_QUOTA
            freed = machine.offload(tenant, request_id, held)
            return (0, NOT_SUSPENDED_ANY_MORE) if freed is None else (freed, None)

        await self._owners.run(
            step["instance"],
            offload,
            lambda outcome: [(STEP_DONE, step_done(job_id, seq, outcome))],
        )

    async def compress(self, job_id: str, seq: int) -> bool:
        """Apply a COMPRESS step whose session the CPU tier demoted: its bytes move to the
        compressed tier by what was measured, in the batch that marks the step, so a step is
        applied once however often it is retried. False: the step was no longer planned
        (applied or skipped already, or its job cancelled)."""
        measured = await self.claimed_compression(job_id, seq)
        step = await self.next_step(job_id)
        if measured is None or step is None or step["seq"] != seq:
            return False
        tenant, request_id, instance = step["tenant"], step["request_id"], step["instance"]

        def compress(machine: InstanceMachine, now: float) -> tuple[int, str | None]:
            record = machine.reservations.get((tenant, request_id))
            if record is None or record.offloaded_bytes is None:
                return 0, NOT_OFFLOADED_ANY_MORE
            if record.compressed_bytes is not None:
                return 0, COMPRESSED_SINCE_PLAN
            if not measured.before_bytes:
                return 0, NOTHING_TO_DEMOTE
            kept, compressed = measured.booked(record.offloaded_bytes)
            before, after = measured.before_bytes, measured.after_bytes
            # The machine says whether it is still a suspended session in the CPU tier.
            if not machine.compress(tenant, request_id, kept, compressed, before, after):
                return 0, NOT_OFFLOADED_ANY_MORE
            return 0, None

        def marked(outcome: tuple[int, str | None]) -> list[Statement]:
            statements: list[Statement] = [(STEP_DONE, step_done(job_id, seq, outcome))]
            if outcome[1] is None:
                ratio = {"instance": instance, "ratio": measured.ratio}
                statements.append((COMPRESSION_RATIO, ratio))
            return statements

        await self._owners.run(instance, compress, marked)
        return True


def pool_blocks(machine: InstanceMachine) -> PoolBlocks:
    """What the planner needs of a machine's slots."""
    pool = machine.pool
    scopes = machine.scopes
    cached = Counter(scopes[pool.scope_id(b)] for b in pool.lru_order())
    pinned = {b for pin in machine.pins.values() for b in pin.table.live_blocks()}
    pinned_only = Counter(scopes[pool.scope_id(b)] for b in pinned if pool.state(b) == "PINNED")
    admitted = sorted(
        (r for r in machine.reservations.values() if r.on_gpu),
        key=lambda r: (r.admitted_at or 0.0, r.arrival),
    )
    reservations = []
    for seq, record in enumerate(admitted, start=1):
        assert record.table is not None
        blocks, generations = record.table.live_columns()
        # Each block's counts read in one call per table, and the shared ones found in C: a
        # 1,000,000-slot pool's plan read ~800,000 blocks one method call at a time.
        refs, pins = pool.ref_counts(blocks), pool.pin_counts(blocks)
        shared = compress(range(len(refs)), map(gt, refs, repeat(1)))
        reservations.append(
            LiveReservation(
                record.key[0],
                record.key[1],
                record.params.priority,
                seq,
                record.suspended_at is not None,
                len(blocks),
                len(pins) - pins.count(0),
                tuple(
                    SharedEntry(blocks[i], generations[i], refs[i]) for i in shared if not pins[i]
                ),
            )
        )
    return PoolBlocks(
        tuple(CachedScope(scope, n) for scope, n in sorted(cached.items())),
        tuple(reservations),
        tuple(sorted(pinned_only.items())),
    )
