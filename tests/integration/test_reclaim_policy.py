"""The reclaim policy starts jobs itself: an instance in use above its watermark while work
waits, a tenant holding more than its quota after a cut; one job per scope at a time, and the
same job when replicas decide at once."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from sqlalchemy.ext.asyncio import AsyncEngine

from quota_service.api.server import HotPath
from quota_service.config import Settings
from quota_service.core.model import ReservationState
from quota_service.core.pagination import Page
from quota_service.core.reclaim import ReclaimTarget, Tier
from quota_service.enforcement.cpu_tier_mirror import CpuTierMirror
from quota_service.enforcement.termination import Termination
from quota_service.jobs.reclaim_executor import ReclaimExecutor
from quota_service.jobs.reclaim_policy import ReclaimPolicy
from quota_service.store.cpu_tier import CpuTierBooks
from tests.integration.invariants import assert_invariants
from tests.integration.ledger_fixtures import add_instance, add_tenant, request
from tests.integration.test_reclaim_evict import running


async def test_a_hot_instance_with_work_waiting_preempts_down_to_its_watermark(
    engine: AsyncEngine, settings: Settings, owned: HotPath
) -> None:
    await add_instance(engine, blocks=16)
    await add_tenant(engine, "acme")
    ledger = owned.ledger
    for i in range(4):  # 16 of 16 blocks in use
        await ledger.admit(running(f"r{i}", prompt=tuple(range(i * 100, i * 100 + 63))))
    waiting, _ = await ledger.admit(replace(request("waiting", 63, 1), wait_timeout_seconds=60))
    assert waiting.state is ReservationState.QUEUED
    jobs = owned.reclaim(engine, settings.cpu_watermarks)
    # Allowed only to offload, with no idle session to take: no job, not even an empty one.
    assert await ReclaimPolicy(jobs, Tier.OFFLOAD, 0.9, 30).sweep() == 0
    assert await jobs.list_jobs(Page(10, None)) == []
    policy = ReclaimPolicy(jobs, Tier.EVICT, watermark=0.9, cooldown_seconds=30)
    # Two replicas decide at the same moment: one job. The later one either finds it open or
    # creates it again (its request_id names the scope and the period), as the timing falls.
    assert sorted(await asyncio.gather(policy.sweep(), policy.sweep())) in ([0, 1], [1, 1])
    (job,) = await jobs.list_jobs(Page(10, None))
    assert job.target == ReclaimTarget(2, Tier.EVICT, None, Tier.OFFLOAD)  # 16 - 14
    assert [s.planned.reservation for s in job.steps] == [("acme", "r3")]  # newest first
    assert await policy.sweep() == 0  # its scope has a job open
    termination = Termination(ledger, abort_timeout_seconds=0.5, hard_timeout_seconds=5)
    executor = ReclaimExecutor(jobs, termination, CpuTierMirror(CpuTierBooks(engine)))
    assert await executor.run(job.job_id, 10) == 1
    # The owner dispatches its queue in the transition that gave the blocks back.
    assert await ledger.dispatch("gpu-0") == 0
    assert (await ledger.get("acme", "waiting")).state is ReservationState.ADMITTED
    await termination.close()
    await assert_invariants(engine)


async def test_a_tenant_over_its_cut_quota_gives_back_its_excess(
    engine: AsyncEngine, settings: Settings, owned: HotPath
) -> None:
    await add_instance(engine, blocks=64)
    await add_tenant(engine, "acme")
    ledger = owned.ledger
    for i in range(3):
        await ledger.admit(running(f"r{i}", prompt=tuple(range(i * 100, i * 100 + 63))))
    await owned.catalog.update_tenant("acme", {"max_blocks": 6})  # holds 12
    jobs = owned.reclaim(engine, settings.cpu_watermarks)
    assert await ReclaimPolicy(jobs, Tier.EVICT, 0.9, 30).sweep() == 1
    (job,) = await jobs.list_jobs(Page(10, None))
    assert job.target == ReclaimTarget(6, Tier.EVICT, "acme", Tier.OFFLOAD)
    assert [s.planned.reservation for s in job.steps] == [("acme", "r2"), ("acme", "r1")]
    assert await ReclaimPolicy(jobs, None, 0.9, 30).sweep() == 0  # policy off
