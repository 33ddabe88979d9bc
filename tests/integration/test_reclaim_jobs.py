"""Reclaim jobs run by the instance's owner: a dry run and an execution agree except where the
pool changed (listed), a FREE step takes the least damaging cached blocks a batch at a time, a
killed owner's job resumes in the next owner without applying a step twice, refusals change
nothing."""

from __future__ import annotations

import asyncio
import signal
import sys
from dataclasses import replace

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from kvquota.v1 import admin_pb2, admin_pb2_grpc, admission_pb2, admission_pb2_grpc
from kvquota.v1 import resources_pb2 as pb
from quota_service.api.server import HotPath, make_hot_path
from quota_service.api.waiting import Waiters
from quota_service.config import Settings
from quota_service.core.errors import Code, KvQuotaError, ServedElsewhere
from quota_service.core.model import EndReason
from quota_service.core.pagination import Page
from quota_service.core.reclaim import JobState, ReclaimTarget, StepState, Tier
from quota_service.owner.owned_reclaim import FREE_BATCH_BLOCKS, OwnedReclaimJobs
from quota_service.owner.owners import OwnedLedger
from quota_service.store.reclaim import CHANGED_SINCE_PLAN, FEWER_CACHED_SINCE_PLAN
from tests import processes
from tests.integration.grpc_helpers import admit
from tests.integration.invariants import assert_invariants
from tests.integration.ledger_fixtures import add_instance, add_tenant, counters, request

BS = 16


def prompt(i: int) -> tuple[int, ...]:
    """The i-th 4-block prompt of the pools below."""
    return tuple(range(i * 1000, i * 1000 + 4 * BS))


async def cached_pool(
    engine: AsyncEngine, owned: HotPath, blocks: int, tenant: str = "acme"
) -> OwnedLedger:
    """An instance whose tenant left `blocks` cached prompt blocks behind (4 a prompt)."""
    await add_instance(engine, blocks=blocks + 64)
    await add_tenant(engine, tenant)
    await leave_cached(owned.ledger, tenant, range(blocks // 4))
    return owned.ledger


def jobs_of(
    engine: AsyncEngine, owned: HotPath, free_batch_blocks: int = FREE_BATCH_BLOCKS
) -> OwnedReclaimJobs:
    return OwnedReclaimJobs(engine, owned.owners, free_batch_blocks=free_batch_blocks)


async def leave_cached(ledger: OwnedLedger, tenant: str, prompts: range) -> None:
    for i in prompts:
        tokens = prompt(i)
        base = request(f"r{i}", len(tokens), 1, tenant=tenant)
        await ledger.admit(replace(base, prompt_token_ids=tokens))
        await ledger.end(tenant, f"r{i}", EndReason.RELEASED, 1)


async def prefix_hits(ledger: OwnedLedger, tenant: str, request_id: str, i: int) -> int:
    """How many of the i-th prompt's blocks are still cached (a request reusing them, one token
    longer: a hit never covers a prompt's last token, as in vLLM)."""
    tokens = (*prompt(i), 1)
    base = request(request_id, len(tokens), 1, tenant=tenant)
    admitted, _ = await ledger.admit(replace(base, prompt_token_ids=tokens))
    return admitted.prefix_hit_blocks


async def test_a_dry_run_and_its_execution_agree_but_for_what_changed(
    engine: AsyncEngine, owned: HotPath
) -> None:
    ledger = await cached_pool(engine, owned, 8)
    jobs = jobs_of(engine, owned)
    target = ReclaimTarget(6, Tier.FREE)
    dry = await jobs.create("dry", "gpu-0", target, dry_run=True)
    assert (dry.state, dry.expected_blocks, len(dry.steps)) == (JobState.SUCCEEDED, 6, 1)
    assert (dry.steps[0].planned.tier, dry.steps[0].planned.gpu_blocks) == (Tier.FREE, 6)
    assert await jobs.run_step(dry.job_id) is False  # a dry run is never executed

    job = await jobs.create("real", "gpu-0", target, dry_run=False)
    assert [s.planned for s in job.steps] == [s.planned for s in dry.steps]
    # Before it runs, a request reuses the first prompt's blocks (a prefix hit): those blocks
    # are in use now and must not be taken; only 4 cached ones are left.
    assert await prefix_hits(ledger, "acme", "again", 0) == 4
    while await jobs.run_step(job.job_id):
        pass
    done = await jobs.get(job.job_id)
    assert done.state is JobState.SUCCEEDED
    (step,) = done.steps
    assert (step.state, step.actual_blocks, step.note) == (
        StepState.APPLIED,
        4,
        FEWER_CACHED_SINCE_PLAN,
    )
    assert done.differences == (step,)
    books = (await counters(engine))["instance:gpu-0"]
    assert books["cached_blocks"] == 8 - 4 - 4  # 4 in use again, the 4 others freed
    assert (await ledger.get("acme", "again")).prefix_hit_blocks == 4
    await assert_invariants(engine)


async def test_free_takes_cold_scopes_first_then_the_least_recently_used(
    engine: AsyncEngine, owned: HotPath
) -> None:
    """Cached blocks of tenants with no live work go first; within each, least recently used
    first, a table's tail before its head (as vLLM evicts); a tenant's job takes only its own."""
    ledger = await cached_pool(engine, owned, 8)  # acme: prompts 0 and 1
    await add_tenant(engine, "globex")
    await leave_cached(ledger, "globex", range(2, 4))  # released after acme's: hotter
    busy = tuple(range(50_000, 50_000 + BS))
    await ledger.admit(replace(request("busy", len(busy), 1), prompt_token_ids=busy))
    jobs = jobs_of(engine, owned)
    job = await jobs.create("mixed", "gpu-0", ReclaimTarget(10, Tier.FREE), dry_run=False)
    assert [(s.planned.tier, s.planned.gpu_blocks) for s in job.steps] == [(Tier.FREE, 10)]
    assert await jobs.run_step(job.job_id) and not await jobs.run_step(job.job_id)
    # globex is cold: all 8 of its blocks went; then acme's oldest prompt's tail.
    assert await prefix_hits(ledger, "globex", "g", 2) == 0
    assert await prefix_hits(ledger, "acme", "a0", 0) == 2
    assert await prefix_hits(ledger, "acme", "a1", 1) == 4
    for rid in ("a0", "a1"):  # both prompts whole in the cache again
        await ledger.end("acme", rid, EndReason.RELEASED, 1)
    # acme's own job: only acme's cached blocks, never another tenant's.
    await leave_cached(ledger, "globex", range(4, 5))
    acme = ReclaimTarget(100, Tier.FREE, tenant="acme")
    only = await jobs.create("acme-only", "gpu-0", acme, dry_run=False)
    assert only.expected_blocks == 8
    while await jobs.run_step(only.job_id):
        pass
    assert (await jobs.get(only.job_id)).actual_blocks == 8
    assert await prefix_hits(ledger, "globex", "g4", 4) == 4
    await assert_invariants(engine)


async def test_a_free_step_frees_a_batch_per_transaction_and_shows_its_progress(
    engine: AsyncEngine, owned: HotPath
) -> None:
    await cached_pool(engine, owned, 12)
    jobs = jobs_of(engine, owned, 5)
    job = await jobs.create("batched", "gpu-0", ReclaimTarget(12, Tier.FREE), dry_run=False)
    progress = []
    while await jobs.run_step(job.job_id):
        running = await jobs.get(job.job_id)
        progress.append((running.steps[0].state, running.actual_blocks, running.differences))
    assert progress == [
        (StepState.PLANNED, 5, ()),
        (StepState.PLANNED, 10, ()),
        (StepState.APPLIED, 12, ()),
    ]
    assert (await jobs.get(job.job_id)).state is JobState.SUCCEEDED
    assert (await counters(engine))["instance:gpu-0"]["cached_blocks"] == 0
    await assert_invariants(engine)


async def test_a_free_step_planned_block_by_block_still_runs(
    engine: AsyncEngine, owned: HotPath
) -> None:
    """Jobs planned before FREE steps were counted name one block of the per-block tables a
    step; one still open at an upgrade runs on, each step skipped (the pool's slots are not
    those blocks), and nothing in the pool is taken for it."""
    await cached_pool(engine, owned, 8)
    jobs = jobs_of(engine, owned)
    job = await jobs.create("old", "gpu-0", ReclaimTarget(2, Tier.FREE), dry_run=False)
    async with engine.begin() as conn:
        await conn.execute(text("DELETE FROM reclaim_steps"))
        await conn.execute(
            text(
                "INSERT INTO reclaim_steps (job_id, seq, tier, block_id, generation, "
                "expected_blocks, cpu_bytes, lossy) "
                "VALUES (:job_id, 0, 'FREE', 0, 1, 1, 0, false), "
                "(:job_id, 1, 'FREE', 1, 1, 1, 0, false)"
            ),
            {"job_id": job.job_id},
        )
    while await jobs.run_step(job.job_id):
        pass
    done = await jobs.get(job.job_id)
    assert [(s.planned.block is not None, s.state, s.actual_blocks) for s in done.steps] == [
        (True, StepState.SKIPPED, 0),
        (True, StepState.SKIPPED, 0),
    ]
    assert all(s.note == CHANGED_SINCE_PLAN for s in done.differences)
    assert (await counters(engine))["instance:gpu-0"]["cached_blocks"] == 8
    await assert_invariants(engine)


EXECUTOR = """
import asyncio, sys
from quota_service.api.server import make_hot_path
from quota_service.api.waiting import Waiters
from quota_service.config import Settings
from quota_service.owner.owned_reclaim import FREE_BATCH_BLOCKS, OwnedReclaimJobs
from quota_service.store.database import connect

async def main(url, job_id):
    engine = connect(url, pool_size=2)
    settings = Settings(owner_lease_seconds=1.0)
    owned = make_hot_path(settings, engine, Waiters(0.05), "executor")
    jobs = OwnedReclaimJobs(engine, owned.owners, free_batch_blocks=1)
    while await jobs.run_step(job_id):
        print("step", flush=True)
        await asyncio.sleep(0.2)

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


async def test_a_killed_owner_s_job_resumes_in_the_next_and_frees_each_block_once(
    engine: AsyncEngine, settings: Settings, owned: HotPath, database_url: str
) -> None:
    """The owner that runs a job's steps is killed between them: each batch it acknowledged
    was recorded with the step's progress, so the next owner, recovered from the record, goes
    on from there and frees no block twice."""
    await cached_pool(engine, owned, 12)
    jobs = jobs_of(engine, owned, 1)
    job = await jobs.create("kill-me", "gpu-0", ReclaimTarget(12, Tier.FREE), dry_run=False)
    await owned.owners.hand_over()  # the executor's replica takes gpu-0 over
    process = await processes.exec_async(
        sys.executable, "-c", EXECUTOR, database_url, job.job_id, stdout=asyncio.subprocess.PIPE
    )
    assert process.stdout is not None
    for _ in range(3):
        assert await process.stdout.readline() == b"step\n"
    process.send_signal(signal.SIGKILL)
    await process.wait()
    interrupted = await jobs.get(job.job_id)
    assert interrupted.state is JobState.RUNNING and 3 <= interrupted.actual_blocks < 12
    assert interrupted.steps[0].state is StepState.PLANNED

    short = replace(settings, owner_lease_seconds=1.0)
    successor = make_hot_path(short, engine, Waiters(0.05), "successor")
    resumed = jobs_of(engine, successor, 1)
    try:
        while True:  # the killed owner's lease runs out first
            try:
                if not await resumed.run_step(job.job_id):
                    break
            except ServedElsewhere:
                await asyncio.sleep(0.2)
        done = await resumed.get(job.job_id)
        assert (done.state, done.actual_blocks) == (JobState.SUCCEEDED, 12)
        assert [(s.state, s.actual_blocks, s.note) for s in done.steps] == [
            (StepState.APPLIED, 12, None)
        ]
        assert (await counters(engine))["instance:gpu-0"]["cached_blocks"] == 0
    finally:
        await successor.owners.close()
    await assert_invariants(engine)


async def test_concurrent_executors_share_a_job_without_applying_a_step_twice(
    engine: AsyncEngine, owned: HotPath
) -> None:
    await cached_pool(engine, owned, 16)
    jobs = jobs_of(engine, owned, 1)
    job = await jobs.create("shared", "gpu-0", ReclaimTarget(16, Tier.FREE), dry_run=False)

    async def executor() -> int:
        batches = 0
        while await jobs.run_step(job.job_id):
            batches += 1
        return batches

    assert sum(await asyncio.gather(*(executor() for _ in range(4)))) == 16
    assert (await jobs.get(job.job_id)).actual_blocks == 16
    await assert_invariants(engine)


async def test_every_replica_s_maintenance_loop_executes_open_jobs(
    engine: AsyncEngine,
    gateway: admission_pb2_grpc.AdmissionServiceAsyncStub,
    admin: admin_pb2_grpc.AdminServiceAsyncStub,
) -> None:
    await add_instance(engine, blocks=8 + 64)
    await add_tenant(engine, "acme")
    for i in range(2):  # each prompt's 4 blocks stay cached
        tokens = prompt(i)
        done = await gateway.Admit(admit(f"r{i}", len(tokens), 1, prompt_token_ids=tokens))
        await gateway.Release(admission_pb2.ReleaseRequest(name=done.reservation.name))
    job = await admin.CreateReclaimJob(
        admin_pb2.CreateReclaimJobRequest(
            instance="instances/gpu-0",
            target_blocks=8,
            max_tier=pb.RECLAIM_TIER_FREE,
            request_id="loop",
        )
    )
    for _ in range(100):
        job = await admin.GetReclaimJob(admin_pb2.GetReclaimJobRequest(name=job.name))
        if job.state == pb.RECLAIM_JOB_STATE_SUCCEEDED:
            break
        await asyncio.sleep(0.1)
    assert job.actual_blocks == 8
    await assert_invariants(engine)


async def test_a_cancelled_job_keeps_what_it_applied_and_runs_nothing_more(
    engine: AsyncEngine, owned: HotPath
) -> None:
    await cached_pool(engine, owned, 8)
    jobs = jobs_of(engine, owned, 1)
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
    engine: AsyncEngine, owned: HotPath
) -> None:
    """Executors racing a cancel: the job the cancel returns is the job's final state."""
    await cached_pool(engine, owned, 32)
    jobs = jobs_of(engine, owned, 1)
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
    if final.state is JobState.CANCELLED:  # else all 32 batches beat the cancel
        assert final.actual_blocks < 32
    await assert_invariants(engine)


async def test_bad_jobs_are_refused_and_change_nothing(engine: AsyncEngine, owned: HotPath) -> None:
    await cached_pool(engine, owned, 4)
    jobs = jobs_of(engine, owned)
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
