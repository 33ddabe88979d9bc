"""Suspended sessions and the OFFLOAD tier: a reclaim moves an idle session's blocks off the
GPU while the CPU tier has room below its watermark; resuming brings it back through the
instance's queue (at once when there is room), or is refused and leaves it offloaded."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from quota_service.api.server import HotPath
from quota_service.core import catalog, geometry
from quota_service.core.admission import AdmitRequest
from quota_service.core.errors import Code, KvQuotaError
from quota_service.core.model import EndReason, EngineEndpoints, LmcacheEndpoint, ReservationState
from quota_service.core.reclaim import (
    DEFAULT_WATERMARKS,
    JobState,
    ReclaimTarget,
    Tier,
    Unreclaimable,
)
from quota_service.enforcement.cpu_tier_mirror import CpuTierMirror
from quota_service.enforcement.termination import Termination
from quota_service.jobs.reclaim_executor import ReclaimExecutor
from quota_service.store.catalog import Catalog
from quota_service.store.cpu_tier import CpuTierBooks
from quota_service.store.reclaim import (
    NOT_SUSPENDED_ANY_MORE,
    OVER_TENANT_CPU_QUOTA,
    ended_before_preemption,
)
from tests.integration.invariants import assert_invariants
from tests.integration.ledger_fixtures import add_tenant, derived_counters, request

BS = 16
GEOMETRY = geometry.KvGeometry(2, 2, 64, geometry.KvDtype.FP16)  # 16 KiB a block
BLOCK_BYTES = 16384


def session(request_id: str, first_token: int, blocks: int = 4) -> AdmitRequest:
    """A turn of `blocks` blocks: blocks * 16 - 1 prompt tokens and 1 output token."""
    prompt = tuple(range(first_token, first_token + blocks * BS - 1))
    base = request(request_id, len(prompt), 1)
    return replace(base, prompt_token_ids=prompt)


async def with_cpu_tier(engine: AsyncEngine, blocks: int, cpu_used: int, cpu_capacity: int) -> None:
    lmcache = LmcacheEndpoint("http://127.0.0.1:1", "mp-1", "m")
    endpoints = EngineEndpoints("http://127.0.0.1:1", lmcache=lmcache)
    spec = catalog.instance_spec("gpu-0", "m", GEOMETRY, BS, 8192, None, blocks, engine=endpoints)
    await Catalog(engine).register_instance(spec)
    await CpuTierBooks(engine).record_usage("gpu-0", cpu_used, cpu_capacity)
    await add_tenant(engine, "acme")


async def test_an_idle_session_is_offloaded_and_comes_back_with_its_prefix(
    engine: AsyncEngine, owned: HotPath
) -> None:
    await with_cpu_tier(engine, blocks=16, cpu_used=0, cpu_capacity=1 << 20)
    ledger = owned.ledger
    chat, _ = await ledger.admit(session("chat", 0))
    await ledger.admit(session("busy", 5000))
    turn = tuple(range(4 * BS))  # the prompt and the token generated
    suspended = await ledger.suspend("acme", "chat", turn)
    assert suspended.suspended_at is not None
    assert await ledger.suspend("acme", "chat", turn) == suspended  # idempotent

    jobs = owned.reclaim(engine, DEFAULT_WATERMARKS)
    job = await jobs.create("offload", "gpu-0", ReclaimTarget(4, Tier.OFFLOAD), dry_run=False)
    assert [(s.planned.tier, s.planned.reservation, s.planned.cpu_bytes) for s in job.steps] == [
        (Tier.OFFLOAD, ("acme", "chat"), 4 * BLOCK_BYTES)
    ]
    while await jobs.run_step(job.job_id):
        pass
    done = await jobs.get(job.job_id)
    assert (done.state, done.actual_blocks, done.differences) == (JobState.SUCCEEDED, 4, ())
    offloaded = await ledger.get("acme", "chat")
    assert (offloaded.state, offloaded.offloaded_bytes, offloaded.block_table) == (
        ReservationState.ADMITTED,
        4 * BLOCK_BYTES,
        (),
    )
    acme = (await derived_counters(engine, owned))["tenant:acme"]
    assert (acme["blocks_in_use"], acme["tokens_in_flight"]) == (4, 4 * BS)  # "busy" alone
    await assert_invariants(engine)

    resumed = await ledger.resume("acme", "chat", 0.0)
    assert (resumed.state, resumed.suspended_at, resumed.offloaded_bytes) == (
        ReservationState.ADMITTED,
        None,
        None,
    )
    # Its three full prompt blocks were still cached: the session's tokens found them.
    assert (resumed.reserved_blocks, resumed.prefix_hit_blocks) == (chat.reserved_blocks, 3)
    await assert_invariants(engine)


async def test_a_resume_without_room_is_refused_or_waits_in_the_queue(
    engine: AsyncEngine, owned: HotPath
) -> None:
    await with_cpu_tier(engine, blocks=8, cpu_used=0, cpu_capacity=1 << 20)
    ledger = owned.ledger
    await ledger.admit(session("chat", 0))
    await ledger.suspend("acme", "chat", ())
    jobs = owned.reclaim(engine, DEFAULT_WATERMARKS)
    job = await jobs.create("offload", "gpu-0", ReclaimTarget(4, Tier.OFFLOAD), dry_run=False)
    while await jobs.run_step(job.job_id):
        pass
    await ledger.admit(session("big", 9000, blocks=8))  # takes every slot
    with pytest.raises(KvQuotaError) as refused:
        await ledger.resume("acme", "chat", 0.0)
    assert (refused.value.code, refused.value.reason) == (Code.UNAVAILABLE, "INSTANCE_OVERLOADED")
    assert refused.value.retry_delay_seconds is not None
    still = await ledger.get("acme", "chat")
    assert (still.state, still.offloaded_bytes) == (ReservationState.ADMITTED, 4 * BLOCK_BYTES)
    await assert_invariants(engine)

    # A resume whose wait runs out does not end the session: it goes back to the CPU tier.
    short = await ledger.resume("acme", "chat", 1.0)
    assert short.state is ReservationState.QUEUED
    assert await ledger.resume("acme", "chat", 1.0) == short  # a retry joins the same wait
    await asyncio.sleep(1.1)
    assert await ledger.dispatch("gpu-0") == 0  # its deadline passed: out of the queue
    back_in_cpu = await ledger.get("acme", "chat")
    assert (back_in_cpu.state, back_in_cpu.offloaded_bytes) == (
        ReservationState.ADMITTED,
        4 * BLOCK_BYTES,
    )
    assert back_in_cpu.suspended_at is not None
    await assert_invariants(engine)

    queued = await ledger.resume("acme", "chat", 30.0)
    assert queued.state is ReservationState.QUEUED
    # The release dispatches the queue in its own step: the session is back on the GPU, and a
    # dispatch after it finds nothing more to admit.
    await ledger.end("acme", "big", EndReason.RELEASED, 1)
    assert await ledger.dispatch("gpu-0") == 0
    back = await ledger.get("acme", "chat")
    assert (back.state, back.offloaded_bytes, len(back.block_table)) == (
        ReservationState.ADMITTED,
        None,
        4,
    )
    await assert_invariants(engine)


async def test_offload_needs_room_below_the_watermark_and_a_suspension(
    engine: AsyncEngine, owned: HotPath
) -> None:
    await with_cpu_tier(engine, blocks=16, cpu_used=1 << 20, cpu_capacity=1 << 20)  # full
    ledger = owned.ledger
    await ledger.admit(session("chat", 0))
    await ledger.suspend("acme", "chat", ())
    jobs = owned.reclaim(engine, DEFAULT_WATERMARKS)
    full = await jobs.create("full", "gpu-0", ReclaimTarget(4, Tier.OFFLOAD), dry_run=True)
    assert full.steps == ()
    assert [(e.reason, e.blocks) for e in full.excluded] == [(Unreclaimable.CPU_TIER_FULL, 4)]
    # Allowed to EVICT, the idle session the CPU tier cannot take goes first.
    evict = await jobs.create("evict", "gpu-0", ReclaimTarget(4, Tier.EVICT), dry_run=True)
    assert [(s.planned.tier, s.planned.reservation) for s in evict.steps] == [
        (Tier.EVICT, ("acme", "chat"))
    ]

    await CpuTierBooks(engine).record_usage("gpu-0", 0, 1 << 20)
    job = await jobs.create("offload", "gpu-0", ReclaimTarget(4, Tier.OFFLOAD), dry_run=False)
    await ledger.resume("acme", "chat", 0.0)  # the gateway resumed it before the step ran
    while await jobs.run_step(job.job_id):
        pass
    skipped = (await jobs.get(job.job_id)).steps[0]
    assert (skipped.actual_blocks, skipped.note) == (0, NOT_SUSPENDED_ANY_MORE)
    with pytest.raises(KvQuotaError) as bad:
        await ledger.suspend("acme", "chat", tuple(range(10_000)))
    assert bad.value.code is Code.INVALID_ARGUMENT
    await ledger.end("acme", "chat", EndReason.RELEASED, 1)
    with pytest.raises(KvQuotaError) as ended:
        await ledger.resume("acme", "chat", 0.0)
    assert (ended.value.code, ended.value.reason) == (Code.FAILED_PRECONDITION, "RESERVATION_ENDED")
    await assert_invariants(engine)


async def test_offload_keeps_within_the_tenants_cpu_tier_quota(
    engine: AsyncEngine, owned: HotPath
) -> None:
    """The CPU tier has room for both sessions; acme's quota (max_cpu_tier_bytes) for one. The
    plan offloads one and says why the other stays; a step planned while there was room is
    skipped once the quota is lowered before it runs."""
    await with_cpu_tier(engine, blocks=16, cpu_used=0, cpu_capacity=1 << 30)
    catalog_ = owned.catalog
    await catalog_.update_tenant("acme", {"max_cpu_tier_bytes": 6 * BLOCK_BYTES})
    ledger = owned.ledger
    for name, first in (("one", 0), ("two", 5000)):
        await ledger.admit(session(name, first))
        await ledger.suspend("acme", name, ())
    jobs = owned.reclaim(engine, DEFAULT_WATERMARKS)
    job = await jobs.create("offload", "gpu-0", ReclaimTarget(8, Tier.OFFLOAD), dry_run=False)
    assert [s.planned.reservation for s in job.steps] == [("acme", "one")]
    assert [(e.reason, e.blocks, e.reservation) for e in job.excluded] == [
        (Unreclaimable.TENANT_CPU_QUOTA, 4, ("acme", "two"))
    ]
    await catalog_.update_tenant("acme", {"max_cpu_tier_bytes": 2 * BLOCK_BYTES})
    while await jobs.run_step(job.job_id):
        pass
    skipped = (await jobs.get(job.job_id)).steps[0]
    assert (skipped.actual_blocks, skipped.note) == (0, OVER_TENANT_CPU_QUOTA)
    assert (await ledger.get("acme", "one")).offloaded_bytes is None
    await assert_invariants(engine)


async def test_a_dry_run_across_every_tier_and_its_execution_agree_but_for_what_changed(
    engine: AsyncEngine, owned: HotPath
) -> None:
    """Cached blocks, an idle session the CPU tier takes, one it cannot, and running work: the
    executed job gives back what the dry run said, less the steps whose subject changed in
    between, each listed with its reason."""
    # CPU tier: 1 MiB, offload watermark 0.8: room for one 4-block session (64 KiB) of two
    # once 700 KiB are in use.
    await with_cpu_tier(engine, blocks=40, cpu_used=700 << 10, cpu_capacity=1 << 20)
    ledger = owned.ledger
    await ledger.admit(session("cached", 20_000))
    await ledger.end("acme", "cached", EndReason.RELEASED, 1)  # 3 hashed blocks stay cached
    for name, first in (("idle-1", 0), ("idle-2", 1000)):
        await ledger.admit(session(name, first))
        await ledger.suspend("acme", name, ())
    for name, first in (("run-1", 2000), ("run-2", 3000)):
        await ledger.admit(session(name, first))
    jobs = owned.reclaim(engine, DEFAULT_WATERMARKS)
    target = ReclaimTarget(15, Tier.EVICT)
    dry = await jobs.create("dry", "gpu-0", target, dry_run=True)
    expected = [(s.planned.tier, s.planned.reservation, s.planned.gpu_blocks) for s in dry.steps]
    assert expected == [
        (Tier.FREE, None, 3),
        (Tier.OFFLOAD, ("acme", "idle-1"), 4),  # the CPU tier holds one more session
        (Tier.EVICT, ("acme", "idle-2"), 4),  # ... not two: the other is ended
        (Tier.EVICT, ("acme", "run-2"), 4),  # then running work, newest first
    ]
    assert dry.expected_blocks == 15

    job = await jobs.create("real", "gpu-0", target, dry_run=False)
    assert [s.planned for s in job.steps] == [s.planned for s in dry.steps]
    # Between plan and execution: "run-2" finishes, "idle-1" resumes.
    await ledger.end("acme", "run-2", EndReason.RELEASED, 1)
    await ledger.resume("acme", "idle-1", 0.0)
    termination = Termination(ledger, abort_timeout_seconds=0.5, hard_timeout_seconds=5)
    executor = ReclaimExecutor(jobs, termination, CpuTierMirror(CpuTierBooks(engine)))
    await executor.run(job.job_id, 100)
    done = await jobs.get(job.job_id)
    assert done.state is JobState.SUCCEEDED
    assert [(s.planned.reservation, s.note) for s in done.differences] == [
        (("acme", "idle-1"), NOT_SUSPENDED_ANY_MORE),
        (("acme", "run-2"), ended_before_preemption("RELEASED")),
    ]
    changed = sum(s.planned.gpu_blocks for s in done.differences)
    assert done.actual_blocks == done.expected_blocks - changed == 7
    assert (await ledger.get("acme", "idle-2")).end_reason is EndReason.PREEMPTED
    await termination.close()
    await assert_invariants(engine)
