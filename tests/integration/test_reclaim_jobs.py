"""Reclaim jobs in the ledger: a dry run and an execution agree except where the pool changed
(listed), a killed executor's job resumes without applying a step twice, refusals change nothing."""

from __future__ import annotations

import asyncio
import signal
import sys
from dataclasses import replace

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from quota_service.api import server
from quota_service.config import Settings
from quota_service.core.errors import Code, KvQuotaError
from quota_service.core.model import EndReason
from quota_service.core.pagination import Page
from quota_service.core.reclaim import JobState, ReclaimTarget, StepState, Tier
from quota_service.store.ledger import Ledger
from quota_service.store.reclaim import CHANGED_SINCE_PLAN, ReclaimJobs
from tests.integration.invariants import assert_invariants
from tests.integration.ledger_fixtures import add_instance, add_tenant, counters, request

BS = 16


async def cached_pool(engine: AsyncEngine, settings: Settings, blocks: int) -> Ledger:
    """An instance whose tenant acme left `blocks` cached prompt blocks behind."""
    await add_instance(engine, blocks=blocks + 64)
    await add_tenant(engine, "acme")
    ledger = Ledger(engine, settings.admission_limits)
    for i in range(blocks // 4):
        tokens = tuple(range(i * 1000, i * 1000 + 4 * BS))
        await ledger.admit(replace(request(f"r{i}", len(tokens), 1), prompt_token_ids=tokens))
        await ledger.end("acme", f"r{i}", EndReason.RELEASED, 1)
    return ledger


async def test_a_dry_run_and_its_execution_agree_but_for_what_changed(
    engine: AsyncEngine, settings: Settings
) -> None:
    ledger = await cached_pool(engine, settings, 8)
    jobs = ReclaimJobs(engine)
    target = ReclaimTarget(6, Tier.FREE)
    dry = await jobs.create("dry", "gpu-0", target, dry_run=True)
    assert (dry.state, dry.expected_blocks, len(dry.steps)) == (JobState.SUCCEEDED, 6, 6)
    assert await jobs.run_step(dry.job_id) is False  # a dry run is never executed

    job = await jobs.create("real", "gpu-0", target, dry_run=False)
    assert [s.planned for s in job.steps] == [s.planned for s in dry.steps]
    # Before it runs, a request reuses the first prompt's blocks (a prefix hit): those planned
    # blocks are in use now and must not be taken.
    first = tuple(range(0, 4 * BS))
    again, _ = await ledger.admit(replace(request("again", len(first), 1), prompt_token_ids=first))
    assert again.prefix_hit_blocks == 4
    while await jobs.run_step(job.job_id):
        pass
    done = await jobs.get(job.job_id)
    assert done.state is JobState.SUCCEEDED
    reused = {s.seq for s in done.steps if s.state is StepState.SKIPPED}
    assert len(reused) == 4  # the first prompt's blocks were the least recently used
    assert all(s.note == CHANGED_SINCE_PLAN for s in done.differences)
    assert {s.seq for s in done.differences} == reused
    assert done.actual_blocks == done.expected_blocks - len(reused) == 2
    books = (await counters(engine))["instance:gpu-0"]
    assert books["cached_blocks"] == 8 - 2 - 4  # 2 freed, 4 in use again
    await assert_invariants(engine)


EXECUTOR = """
import asyncio, sys
from quota_service.store.database import connect
from quota_service.store.reclaim import ReclaimJobs

async def main(url, job_id):
    engine = connect(url, pool_size=1)
    jobs = ReclaimJobs(engine)
    while await jobs.run_step(job_id):
        print("step", flush=True)
        await asyncio.sleep(0.2)

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


async def test_a_killed_executor_s_job_resumes_and_applies_each_step_once(
    engine: AsyncEngine, settings: Settings, database_url: str
) -> None:
    await cached_pool(engine, settings, 12)
    jobs = ReclaimJobs(engine)
    job = await jobs.create("kill-me", "gpu-0", ReclaimTarget(12, Tier.FREE), dry_run=False)
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", EXECUTOR, database_url, job.job_id, stdout=asyncio.subprocess.PIPE
    )
    assert process.stdout is not None
    for _ in range(3):
        assert await process.stdout.readline() == b"step\n"
    process.send_signal(signal.SIGKILL)
    await process.wait()
    interrupted = await jobs.get(job.job_id)
    applied = sum(s.state is StepState.APPLIED for s in interrupted.steps)
    assert interrupted.state is JobState.RUNNING and 3 <= applied < 12
    while await jobs.run_step(job.job_id):  # another replica picks it up
        pass
    done = await jobs.get(job.job_id)
    assert (done.state, done.actual_blocks) == (JobState.SUCCEEDED, 12)
    assert all(s.state is StepState.APPLIED and s.actual_blocks == 1 for s in done.steps)
    async with engine.connect() as conn:
        per_block = await conn.execute(
            text(
                "SELECT block_id, count(*) FROM tombstones WHERE reason = 'RECLAIMED' "
                "GROUP BY block_id"
            )
        )
        counts = [n for _, n in per_block]
    assert len(counts) == 12 and set(counts) == {1}  # each block freed exactly once
    await assert_invariants(engine)


async def test_concurrent_executors_share_a_job_without_applying_a_step_twice(
    engine: AsyncEngine, settings: Settings
) -> None:
    await cached_pool(engine, settings, 16)
    jobs = ReclaimJobs(engine)
    job = await jobs.create("shared", "gpu-0", ReclaimTarget(16, Tier.FREE), dry_run=False)

    async def executor() -> int:
        steps = 0
        while await jobs.run_step(job.job_id):
            steps += 1
        return steps

    assert sum(await asyncio.gather(*(executor() for _ in range(4)))) == 16
    assert (await jobs.get(job.job_id)).actual_blocks == 16
    await assert_invariants(engine)


async def test_every_replica_s_maintenance_loop_executes_open_jobs(
    engine: AsyncEngine, settings: Settings, database_url: str
) -> None:
    await cached_pool(engine, settings, 8)
    running = await server.start(settings, database_url)
    try:
        jobs = ReclaimJobs(engine)
        job = await jobs.create("loop", "gpu-0", ReclaimTarget(8, Tier.FREE), dry_run=False)
        for _ in range(100):
            if (await jobs.get(job.job_id)).state is JobState.SUCCEEDED:
                break
            await asyncio.sleep(0.1)
        assert (await jobs.get(job.job_id)).actual_blocks == 8
    finally:
        await running.stop(0)
    await assert_invariants(engine)


async def test_a_cancelled_job_keeps_what_it_applied_and_runs_nothing_more(
    engine: AsyncEngine, settings: Settings
) -> None:
    await cached_pool(engine, settings, 8)
    jobs = ReclaimJobs(engine)
    job = await jobs.create("stop", "gpu-0", ReclaimTarget(8, Tier.FREE), dry_run=False)
    assert await jobs.run_step(job.job_id) and await jobs.run_step(job.job_id)
    cancelled = await jobs.cancel(job.job_id)
    assert (cancelled.state, cancelled.actual_blocks) == (JobState.CANCELLED, 2)
    assert await jobs.run_step(job.job_id) is False
    assert await jobs.cancel(job.job_id) == cancelled  # a repeat changes nothing
    assert (await counters(engine))["instance:gpu-0"]["cached_blocks"] == 6
    other = await jobs.create("other", "gpu-0", ReclaimTarget(1, Tier.FREE), dry_run=True)
    listed = await jobs.list_jobs(Page(1, None))
    assert len(listed) == 1 and listed + await jobs.list_jobs(Page(5, listed[0].job_id)) == sorted(
        [cancelled, other], key=lambda j: j.job_id
    )
    assert await jobs.list_jobs(Page(5, None), instance="gpu-9") == []
    await assert_invariants(engine)


async def test_nothing_is_applied_after_a_cancel_returns(
    engine: AsyncEngine, settings: Settings
) -> None:
    """Executors racing a cancel: the job the cancel returns is the job's final state."""
    await cached_pool(engine, settings, 32)
    jobs = ReclaimJobs(engine)
    job = await jobs.create("race", "gpu-0", ReclaimTarget(32, Tier.FREE), dry_run=False)

    async def executor() -> None:
        while await jobs.run_step(job.job_id):
            pass

    executors = [asyncio.create_task(executor()) for _ in range(4)]
    await asyncio.sleep(0.05)
    cancelled = await jobs.cancel(job.job_id)
    await asyncio.gather(*executors)
    final = await jobs.get(job.job_id)
    assert final == cancelled
    if final.state is JobState.CANCELLED:  # else all 32 steps beat the cancel
        assert final.actual_blocks < 32
    await assert_invariants(engine)


async def test_bad_jobs_are_refused_and_change_nothing(
    engine: AsyncEngine, settings: Settings
) -> None:
    await cached_pool(engine, settings, 4)
    jobs = ReclaimJobs(engine)
    with pytest.raises(KvQuotaError) as empty:
        await jobs.create("zero", "gpu-0", ReclaimTarget(0, Tier.FREE), dry_run=True)
    assert empty.value.code is Code.INVALID_ARGUMENT
    with pytest.raises(KvQuotaError) as missing:
        await jobs.create("nowhere", "gpu-9", ReclaimTarget(1, Tier.FREE), dry_run=True)
    assert missing.value.code is Code.NOT_FOUND
    async with engine.connect() as conn:
        assert (await conn.execute(text("SELECT count(*) FROM reclaim_jobs"))).scalar_one() == 0
    # Planning EVICT is fine; a repeat of the request id returns the same job.
    planned = await jobs.create("plan", "gpu-0", ReclaimTarget(4, Tier.EVICT), dry_run=True)
    assert await jobs.create("plan", "gpu-0", ReclaimTarget(4, Tier.EVICT), dry_run=True) == planned
    with pytest.raises(KvQuotaError) as reused:
        await jobs.create("plan", "gpu-0", ReclaimTarget(5, Tier.EVICT), dry_run=True)
    assert (reused.value.code, reused.value.reason) == (Code.ALREADY_EXISTS, "REQUEST_ID_REUSED")
