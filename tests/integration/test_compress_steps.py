"""COMPRESS steps in the ledger, without an engine: planned per offloaded session where the
instance's CPU tier has a measured ratio, applied once with what was measured whichever
executor gets there, skipped when the session left the CPU tier meanwhile; a resumed session
leaves the compressed tier and its usage."""

from __future__ import annotations

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from quota_service.api.server import HotPath
from quota_service.core.model import ReservationState
from quota_service.core.reclaim import (
    DEFAULT_WATERMARKS,
    CompressMeasurement,
    CpuWatermarks,
    Demotion,
    ReclaimTarget,
    StepState,
    Tier,
    Unreclaimable,
)
from quota_service.owner.owned_reclaim import OwnedReclaimJobs
from quota_service.owner.owners import OwnedLedger
from quota_service.store.cpu_tier import CpuTierBooks
from quota_service.store.reclaim import NOT_OFFLOADED_ANY_MORE
from tests.integration.test_suspend_offload import BLOCK_BYTES, BS, session, with_cpu_tier

FULL = CpuWatermarks(offload=0.5, compress=0.6)  # 900 of 1000 bytes used is above both
COMPRESS_ONLY = ReclaimTarget(1, Tier.COMPRESS, None, Tier.COMPRESS)


def jobs_of(
    engine: AsyncEngine, owned: HotPath, watermarks: CpuWatermarks = DEFAULT_WATERMARKS
) -> OwnedReclaimJobs:
    return OwnedReclaimJobs(engine, owned.owners, watermarks)


async def offloaded(engine: AsyncEngine, owned: HotPath, *request_ids: str) -> OwnedLedger:
    """Sessions of 4 blocks on gpu-0, suspended with their tokens and offloaded."""
    await with_cpu_tier(engine, blocks=16, cpu_used=0, cpu_capacity=1 << 20)
    ledger = owned.ledger
    for i, request_id in enumerate(request_ids):
        await ledger.admit(session(request_id, 1000 * i))
        await ledger.suspend("acme", request_id, tuple(range(1000 * i, 1000 * i + 4 * BS)))
    jobs = jobs_of(engine, owned)
    job = await jobs.create("offload", "gpu-0", ReclaimTarget(16, Tier.OFFLOAD), dry_run=False)
    while await jobs.run_step(job.job_id):
        pass
    await CpuTierBooks(engine).record_usage("gpu-0", 900, 1000)
    return ledger


async def events(engine: AsyncEngine) -> list[tuple[int, int]]:
    query = text(
        "SELECT cpu_bytes, compressed_bytes FROM usage_events WHERE compressed_bytes <> 0 "
        "ORDER BY id"
    )
    async with engine.connect() as conn:
        return [(r[0], r[1]) for r in await conn.execute(query)]


async def test_no_plan_compresses_until_a_ratio_was_measured(
    engine: AsyncEngine, owned: HotPath
) -> None:
    await offloaded(engine, owned, "chat")
    jobs = jobs_of(engine, owned, FULL)
    preview = await jobs.preview("gpu-0", COMPRESS_ONLY)
    assert (preview.steps, [e.reason for e in preview.excluded]) == (
        (),
        [Unreclaimable.NO_COMPRESSION],
    )
    await CpuTierBooks(engine).record_compression_ratio("gpu-0", 0.5)
    preview = await jobs.preview("gpu-0", COMPRESS_ONLY)
    assert [(s.tier, s.reservation, s.cpu_bytes) for s in preview.steps] == [
        (Tier.COMPRESS, ("acme", "chat"), -2 * BLOCK_BYTES)
    ]


async def test_a_step_is_applied_once_with_the_first_measurement(
    engine: AsyncEngine, owned: HotPath
) -> None:
    ledger = await offloaded(engine, owned, "chat")
    await CpuTierBooks(engine).record_compression_ratio("gpu-0", 0.5)
    jobs = jobs_of(engine, owned, FULL)
    job = await jobs.create("compress", "gpu-0", COMPRESS_ONLY, dry_run=False)
    demotion = await jobs.run_step(job.job_id)
    assert demotion == Demotion(0, "acme", "chat", None)
    # Two executors measured; the step keeps the first (a second measures an emptier L1).
    first = CompressMeasurement(4096, 1024, 0)
    assert await jobs.record_measurement(job.job_id, 0, first) == first
    later = CompressMeasurement(0, 0, 0)
    assert await jobs.record_measurement(job.job_id, 0, later) == first
    assert await jobs.run_step(job.job_id) == Demotion(0, "acme", "chat", first)
    assert await jobs.compress(job.job_id, 0) is True
    assert await jobs.compress(job.job_id, 0) is False  # a retry finds it applied
    assert await jobs.run_step(job.job_id) is False
    chat = await ledger.get("acme", "chat")
    whole = 4 * BLOCK_BYTES
    assert (chat.offloaded_bytes, chat.compressed_bytes, chat.compression_ratio) == (
        0,
        whole // 4,
        0.25,
    )
    assert await events(engine) == [(-whole, whole // 4)]
    assert (await jobs.get(job.job_id)).steps[0].state is StepState.APPLIED

    # Resumed: back on the GPU, out of the compressed tier and its usage.
    resumed = await ledger.resume("acme", "chat", 0.0)
    assert (resumed.state, resumed.compressed_bytes, resumed.compression_ratio) == (
        ReservationState.ADMITTED,
        None,
        None,
    )
    assert (await events(engine))[-1] == (0, -(whole // 4))


async def test_a_session_that_left_the_cpu_tier_is_skipped(
    engine: AsyncEngine, owned: HotPath
) -> None:
    ledger = await offloaded(engine, owned, "chat")
    await CpuTierBooks(engine).record_compression_ratio("gpu-0", 0.5)
    jobs = jobs_of(engine, owned, FULL)
    job = await jobs.create("compress", "gpu-0", COMPRESS_ONLY, dry_run=False)
    await jobs.record_measurement(job.job_id, 0, CompressMeasurement(4096, 2048, 0))
    await ledger.resume("acme", "chat", 0.0)  # between the CPU tier's demotion and the ledger
    assert await jobs.compress(job.job_id, 0) is True
    step = (await jobs.get(job.job_id)).steps[0]
    assert (step.state, step.note) == (StepState.SKIPPED, NOT_OFFLOADED_ANY_MORE)
    assert await events(engine) == []
